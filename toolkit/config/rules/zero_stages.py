"""Knobs written for a ZeRO stage the config does not run: which stage reads which key.

DeepSpeed 0.19.8 hands each zero_optimization key to the code of one stage family
(runtime/engine.py `_configure_zero_optimizer`): the ZeRO-1/2 optimizer (zero/stage_1_and_2.py), the
ZeRO-3 optimizer (zero/stage3.py, zero/parameter_offload.py) and zero.Init (zero/partition_parameters.py).
At stage 0 none of them is built. A key only another stage reads is ignored silently: a WARNING that
names the key, the stage and the fix. Where DeepSpeed refuses the combination instead, an ERROR.

    >>> [p.message[:60] for p in stage_problems({"zero_optimization": {"stage": 2, "sub_group_size": 1e9}})]
    ['"sub_group_size" is read only at ZeRO stage 3, but "stage" is']
"""

from toolkit.config.problems import WARNING, Problem

ZERO3, ZERO12, ZERO123, ZERO012 = (3,), (1, 2), (1, 2, 3), (0, 1, 2)

# zero_optimization key (DeepSpeed's field name and its alias, as users write either) -> stages reading it.
READ_AT = {
    **dict.fromkeys([  # stage3.py / parameter_offload.py / zero.Init only
        "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
        "param_persistence_threshold", "stage3_model_persistence_threshold", "model_persistence_threshold",
        "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
        "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential", "allgather_sequential", "offload_param", "cpu_offload_param", "sub_group_size",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "memory_efficient_linear", "override_module_apply", "pipeline_loading_checkpoint",
        "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    ], ZERO3),
    # the ZeRO-1/2 optimizer only
    **dict.fromkeys(["round_robin_gradients", "use_multi_rank_bucket_allreduce", "parameter_alignment",
                     "ignore_unused_parameters"], ZERO12),
    # both ZeRO optimizers (and ZeRO checkpoint loading), never at stage 0
    **dict.fromkeys(["reduce_bucket_size", "contiguous_gradients", "reduce_scatter", "load_from_fp32_weights"],
                    ZERO123),
    # the ZeRO-1/2 optimizer and the BF16 optimizer of stage 0 (bf16 with pipelines); ZeRO-3 never
    "allgather_bucket_size": ZERO012,
}
OFFLOAD_OPTIMIZER_READ_AT = {"super_offload": ZERO3, "cpuadam_cores_perc": ZERO3}  # SuperOffloadOptimizer_Stage3
FATE = {  # what DeepSpeed does at the other stages, where it is more than "ignores it"
    "pipeline_loading_checkpoint": "DeepSpeed ignores it at stage 0 and asserts in load_checkpoint at stages 1-2",
    "zero_quantized_gradients": "DeepSpeed only builds an all-to-all group for it, which ZeRO-3 alone uses",
    "leaf_module": "DeepSpeed marks the modules, but only ZeRO-3 acts on the marks",
}
STAGE_WORDS = {ZERO3: "stage 3", ZERO12: "stages 1 and 2", ZERO123: "stages 1-3", ZERO012: "stages 0-2"}
FIX = {ZERO3: '"stage": 3', ZERO12: '"stage": 1 or 2', ZERO123: '"stage": 1, 2 or 3', ZERO012: '"stage": 0, 1 or 2'}


def zero_stage(cfg: dict) -> tuple[int | None, str]:
    """(stage, how it reads in a message); None when unknown ("auto", a string, not a section)."""
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return None, ""
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        return None, ""
    return stage, f'"stage" is {stage}' + ("" if "stage" in zero else " (not set: DeepSpeed's default)")


def stage_problems(cfg: dict) -> list[Problem]:
    """WARNING for each ZeRO knob the config's stage does not read; ERROR where DeepSpeed refuses it."""
    stage, said = zero_stage(cfg)
    if stage is None:
        return []
    zero = cfg.get("zero_optimization", {})
    problems = [_unread(f"$.zero_optimization.{key}", key, READ_AT[key], said)
                for key in zero if key in READ_AT and stage not in READ_AT[key] and not _offloads_to(zero, key)]
    offload = zero.get("offload_optimizer")
    for key in offload if isinstance(offload, dict) else []:
        if key in OFFLOAD_OPTIMIZER_READ_AT and stage not in OFFLOAD_OPTIMIZER_READ_AT[key]:
            problems.append(_unread(f"$.zero_optimization.offload_optimizer.{key}", key,
                                    OFFLOAD_OPTIMIZER_READ_AT[key], said))
    if stage == 0 and "zero_allow_untested_optimizer" in cfg:
        problems.append(Problem("$.zero_allow_untested_optimizer", f'"zero_allow_untested_optimizer" is read only '
                                f"with ZeRO (stages 1-3), but {said}: DeepSpeed ignores it silently; remove it, "
                                'or set "stage": 1, 2 or 3', WARNING))
    return problems + _refused(cfg, zero, stage, said)


def _offloads_to(zero: dict, key: str) -> bool:
    """offload_param with a real device: rules._offload already reports it as an error."""
    section = zero.get(key)
    return key == "offload_param" and isinstance(section, dict) and section.get("device") not in (None, "none", "auto")


def _unread(path: str, key: str, stages: tuple, said: str) -> Problem:
    fate = FATE.get(key, "DeepSpeed ignores it silently")
    return Problem(path, f'"{key}" is read only at ZeRO {STAGE_WORDS[stages]}, but {said}: {fate}; remove '
                   f'"{key}", or set {FIX[stages]}', WARNING)


def _refused(cfg: dict, zero: dict, stage: int, said: str) -> list[Problem]:
    """Stage combinations DeepSpeed refuses (runtime/config.py _do_error_check, zero/config.py validators)."""
    problems = []
    if zero.get("compute_grad_norm") is False and stage not in ZERO12:
        problems.append(Problem("$.zero_optimization.compute_grad_norm", f'"compute_grad_norm": false works only '
                                f"at ZeRO stages 1 and 2, but {said}: DeepSpeed refuses the config; remove it, "
                                'or set "stage": 1 or 2'))
    offload = zero.get("offload_optimizer")
    ratio = offload.get("ratio") if isinstance(offload, dict) else None
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1 and stage != 3:
        problems.append(Problem("$.zero_optimization.offload_optimizer.ratio", f'"ratio" {ratio} < 1 (partial '
                                f"offload) works only at ZeRO stage 3, but {said}: DeepSpeed asserts; remove it, "
                                'or set "stage": 3'))
    if cfg.get("gradient_allreduce_op") == "sum" and stage == 3:
        problems.append(Problem("$.gradient_allreduce_op", '"gradient_allreduce_op" "sum" with "stage" 3: '
                                'DeepSpeed refuses it with ZeRO-3; use "mean", or "stage" 0-2'))
    if stage == 0:
        problems += _master_weights_at_stage0(cfg, said)
    return problems


def _master_weights_at_stage0(cfg: dict, said: str) -> list[Problem]:
    """fp16/bf16 master-weight switches DeepSpeed asserts need ZeRO 1-3 (read whether or not enabled)."""
    bf16 = "bf16" if "bf16" in cfg else "bfloat16"  # DeepSpeed reads "bfloat16" only when "bf16" is absent
    problems = []
    for section, key in (("fp16", "fp16_master_weights_and_grads"), (bf16, "bf16_master_weights_and_grads"),
                         (bf16, "bf16_optimizer_states")):
        value = cfg.get(section)
        if isinstance(value, dict) and value.get(key) is True:
            problems.append(Problem(f"$.{section}.{key}", f'"{key}": true needs ZeRO stage 1, 2 or 3, but {said}: '
                                    f'DeepSpeed asserts; set "stage": 1, 2 or 3, or remove "{key}"'))
    return problems


__all__ = ["stage_problems", "zero_stage", "READ_AT"]
