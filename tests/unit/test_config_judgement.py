"""Real configs judged the way DeepSpeed 0.19.8 (and the HF Trainer / Accelerate) judge them.

Four classes of misjudgement, each with every instance found in the source:
(a) "auto" counts as set where the HF Trainer / Accelerate fill it (a NOTE; an ERROR under --strict);
(b) null is accepted where DeepSpeed's default is None (null reads as absent);
(c) scheduler/optimizer "type" must be a name DeepSpeed resolves (case-sensitive where DeepSpeed is);
(d) ZeRO knobs of another stage are WARNINGs naming the key, the stage and the fix (ERRORs where
    DeepSpeed refuses the combination).
No torch here: tests/unit/test_config_judgement_deepspeed.py checks the same tables against DeepSpeed.
"""

import json

import pytest

from toolkit.config.problems import ERROR, NOTE, WARNING
from toolkit.config.rules import check_rules
from toolkit.config.validate import check_schema
from toolkit.config.rules.zero_stages import READ_AT

HF_ZERO2 = {  # the HF Trainer's own ds_config_zero2.json template, as projects copy it
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def problems(cfg, world_size=8, strict=False):
    return check_schema(cfg, strict=strict) + check_rules(cfg, world_size=world_size)


def by_severity(cfg, severity, **kw):
    return {p.path: p for p in problems(cfg, **kw) if p.severity == severity}


# (a) "auto" ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
    {"train_batch_size": "auto", "gradient_accumulation_steps": 2},
    {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2},
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
    {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"},
    {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": 1},
])
def test_auto_batch_keys_count_as_set(batch):
    assert by_severity(batch, ERROR) == {}
    assert by_severity(batch, ERROR, world_size=None) == {}
    autos = {f"$.{k}" for k, v in batch.items() if v == "auto"}
    assert set(by_severity(batch, NOTE)) >= autos
    assert set(by_severity(batch, ERROR, strict=True)) == autos  # --strict: "auto" itself is the error


def test_hf_template_is_notes_only_and_strict_refuses_each_auto():
    cfg = {**HF_ZERO2, "zero_optimization": {**HF_ZERO2["zero_optimization"]}}
    assert by_severity(cfg, ERROR) == {}
    notes = by_severity(cfg, NOTE)
    assert {"$.train_batch_size", "$.train_micro_batch_size_per_gpu", "$.gradient_accumulation_steps"} <= set(notes)
    assert "HF Trainer/Accelerate must fill" in notes["$.train_batch_size"].message
    strict = by_severity(cfg, ERROR, strict=True)
    assert set(strict) == {p for p, n in notes.items() if '"auto"' in n.message}
    assert all("write the value" in p.message for p in strict.values())


def test_hf_zero3_template_is_notes_only():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
            "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
    cfg = {**HF_ZERO2, "zero_optimization": zero}
    assert {p.severity for p in problems(cfg)} == {NOTE}


def test_fixed_batch_with_auto_keeps_the_arithmetic_that_holds_whatever_is_filled():
    cfg = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3}
    [p] = by_severity(cfg, ERROR).values()
    assert p.path == "$.train_batch_size"
    assert '"train_batch_size" 64 is not divisible by "gradient_accumulation_steps"(3) * dp(8) = 24' in p.message
    assert '"train_micro_batch_size_per_gpu" ("auto")' in p.message and 'set "train_batch_size": "auto"' in p.message
    assert by_severity({**cfg, "gradient_accumulation_steps": 4}, ERROR) == {}  # 64 = mbs(2) * 4 * 8
    assert by_severity({**cfg, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"},
                       ERROR) == {}  # 64 = 2 * gas(4) * 8


def test_auto_gas_alone_names_what_deepspeed_still_needs():
    [p] = by_severity({"gradient_accumulation_steps": "auto"}, ERROR).values()
    assert p.path == "$" and '"gradient_accumulation_steps": "auto" fills neither' in p.message


@pytest.mark.parametrize("key, stage", [("offload_optimizer", 0), ("offload_param", 2)])
def test_auto_offload_device_is_not_an_offload_at_the_wrong_stage(key, stage):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": stage, key: {"device": "auto", "nvme_path": "auto"}}}
    assert by_severity(cfg, ERROR) == {}
    notes = by_severity(cfg, NOTE)  # nvme_path "auto" is not taken for a directory named "auto"
    assert {f"$.zero_optimization.{key}.device", f"$.zero_optimization.{key}.nvme_path"} <= set(notes)


HF_FILLED = [  # (dotted path, section to put it in): every key transformers 5.24 / accelerate fill when "auto"
    ("train_batch_size", {}), ("train_micro_batch_size_per_gpu", {}), ("gradient_accumulation_steps", {}),
    ("gradient_clipping", {}), ("fp16.enabled", {}), ("bf16.enabled", {}),
    ("zero_optimization.stage", {}), ("zero_optimization.reduce_bucket_size", {"stage": 3}),
    ("zero_optimization.stage3_prefetch_bucket_size", {"stage": 3}),
    ("zero_optimization.stage3_param_persistence_threshold", {"stage": 3}),
    ("zero_optimization.stage3_gather_16bit_weights_on_model_save", {"stage": 3}),
    ("zero_optimization.offload_optimizer.device", {"stage": 3}),
    ("zero_optimization.offload_optimizer.nvme_path", {"stage": 3}),
    ("zero_optimization.offload_param.device", {"stage": 3}),
    ("zero_optimization.offload_param.nvme_path", {"stage": 3}),
    *[(f"optimizer.params.{k}", {"type": t}) for t in ("AdamW", "Adam", "Lamb") for k in ("lr", "betas", "eps",
                                                                                            "weight_decay")],
    *[(f"optimizer.params.{k}", {"type": "Lion"}) for k in ("lr", "betas", "weight_decay")],
    *[(f"optimizer.params.{k}", {"type": t}) for t in ("Adagrad", "SGD") for k in ("lr", "weight_decay")],
    ("optimizer.params.eps", {"type": "Adagrad"}),
    *[(f"scheduler.params.{k}", {"type": "WarmupDecayLR"}) for k in ("warmup_min_lr", "warmup_max_lr",
                                                                     "warmup_num_steps", "total_num_steps")],
    *[(f"scheduler.params.{k}", {"type": "WarmupLR"}) for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")],
    *[(f"scheduler.params.{k}", {"type": "WarmupCosineLR"}) for k in ("warmup_num_steps", "total_num_steps")],
]


@pytest.mark.parametrize("dotted, section", HF_FILLED, ids=[f"{d}-{s.get('type', '')}" for d, s in HF_FILLED])
def test_every_key_the_hf_integration_fills_takes_auto_as_a_note(dotted, section):
    parts = dotted.split(".")
    cfg = {"train_micro_batch_size_per_gpu": 2}
    node = cfg
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, json.loads(json.dumps(section)) if i == 0 else {})
    if section.get("type") in ("WarmupDecayLR", "WarmupCosineLR"):
        node.setdefault("total_num_steps", 10)
    node[parts[-1]] = "auto"
    found = {p.path: p for p in check_schema(cfg)}
    assert found[f"$.{dotted}"].severity == NOTE, found
    assert [p for p in found.values() if p.severity == ERROR] == []


# (b) null --------------------------------------------------------------------------------------------------------

NULL_OK = [  # DeepSpeed's default is None (or a validator maps None to the default): null reads as absent
    "train_batch_size", "gradient_accumulation_steps", "steps_per_print", "vocabulary_size",
    "communication_data_type", "seq_parallel_communication_data_type", "log_level",
    "activation_checkpointing.number_checkpoints", "checkpoint.writer", "checkpoint.writer.data_parallel",
    "flops_profiler.output_file", "data_types.grad_accum_dtype", "data_types.param_dtype", "data_types.buffer_dtype",
    "autotuning.metric_path", "autotuning.arg_mappings", "autotuning.max_train_batch_size",
    "autotuning.model_info_path", "autotuning.model_info",
    "zero_optimization.overlap_comm", "zero_optimization.offload_param", "zero_optimization.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.zenflow", "zero_optimization.leaf_module",
    "optimizer.params", "optimizer.params.foreach", "optimizer.params.fused", "optimizer.type", "scheduler.type",
    "scheduler.params.cycle_second_step_size", "wandb.group", "comet.project", "tensor_parallel.partition_config",
]


def _with(dotted: str, value):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    parts = dotted.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts[0] == "optimizer" and parts[-1] != "type":
        cfg["optimizer"]["type"] = "AdamW"
    if parts[0] == "scheduler":
        cfg["scheduler"].update({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}})
        node = cfg["scheduler"] if parts[-1] == "type" else cfg["scheduler"]["params"]
    node[parts[-1]] = value
    return cfg


@pytest.mark.parametrize("dotted", NULL_OK)
def test_null_is_accepted_where_deepspeeds_default_is_none(dotted):
    found = [p for p in problems(_with(dotted, None)) if p.severity == ERROR]
    assert found == []


@pytest.mark.parametrize("dotted", ["zero_optimization.stage", "gradient_clipping", "torch_autocast.dtype",
                                    "torch_autocast.lower_precision_safe_modules", "pipeline.stages",
                                    "fp16.enabled", "activation_checkpointing.partition_activations"])
def test_null_stays_refused_where_deepspeed_fails_on_it(dotted):
    assert f"$.{dotted}" in by_severity(_with(dotted, None), ERROR)


def test_scheduler_params_null_stays_refused():  # DeepSpeed calls scheduler(optimizer, **params)
    cfg = {"train_batch_size": 8, "scheduler": {"type": "StepLR", "params": None}}
    assert "$.scheduler.params" in by_severity(cfg, ERROR)


def test_null_batch_keys_read_as_absent():
    assert by_severity({"train_batch_size": None, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": None}, ERROR) == {}
    [p] = by_severity({"train_batch_size": None, "train_micro_batch_size_per_gpu": None}, ERROR).values()
    assert "DeepSpeed needs one of them" in p.message


@pytest.mark.parametrize("key, what", [("optimizer", "optimizer"), ("scheduler", "scheduler")])
def test_null_type_warns_that_nothing_is_built(key, what):
    cfg = {"train_batch_size": 8, key: {"type": None, "params": {"lr": 1e-3}}}
    [p] = [p for p in problems(cfg) if p.path == f"$.{key}.type"]
    assert p.severity == WARNING and f"builds no {what}" in p.message and 'ignores its "params"' in p.message
    assert by_severity(cfg, ERROR) == {}  # params of a null type are not checked against any class


# (c) scheduler / optimizer type ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, meant", [("warmuplr", "WarmupLR"), ("WarmupLr", "WarmupLR"),
                                         ("warmup_decay_lr", "WarmupDecayLR"), ("onecycle", "OneCycle"),
                                         ("steplr", "StepLR"), ("cosineannealinglr", "CosineAnnealingLR"),
                                         ("WarmupCosineLr", "WarmupCosineLR")])
def test_scheduler_type_typos_get_did_you_mean(name, meant):
    [problem] = check_schema({"scheduler": {"type": name, "params": {}}})
    assert (problem.path, problem.severity) == ("$.scheduler.type", ERROR)
    assert f'"type" is "{name}"; expected one of LRRangeTest, OneCycle, WarmupLR' in problem.message
    assert f'did you mean "{meant}"?' in problem.message
    if name.lower() == meant.lower():
        assert "(scheduler names are case-sensitive)" in problem.message


def test_unknown_scheduler_without_a_close_name_lists_the_names():
    [problem] = check_schema({"scheduler": {"type": "Banana", "params": {}}})
    message = problem.message
    assert "expected one of" in message and "ReduceLROnPlateau" in message and "did you mean" not in message


@pytest.mark.parametrize("name", ["WarmupLR", "LRRangeTest", "StepLR", "CosineAnnealingLR", "ReduceLROnPlateau",
                                  "OneCycleLR", "LinearLR"])
def test_schedulers_deepspeed_resolves_pass(name):
    assert check_schema({"scheduler": {"type": name, "params": {}}}) == []


@pytest.mark.parametrize("section, name, why", [("scheduler", "LambdaLR", "lr_lambda"),
                                                ("scheduler", "SequentialLR", "scheduler objects"),
                                                ("scheduler", "LRScheduler", "abstract base class"),
                                                ("optimizer", "LBFGS", "closure"),
                                                ("optimizer", "Optimizer", "abstract base class")])
def test_classes_deepspeed_finds_but_cannot_build_from_json_are_refused_with_the_reason(section, name, why):
    [problem] = check_schema({section: {"type": name, "params": {}}})
    message = problem.message
    assert "DeepSpeed finds the class, but" in message and why in message and "use one of" in message


@pytest.mark.parametrize("name, meant", [("sgd", "SGD"), ("rmsprop", "RMSprop"), ("Adamw_", "AdamW"),
                                         ("nadam", "NAdam")])
def test_optimizer_type_typos_get_did_you_mean(name, meant):
    [problem] = check_schema({"optimizer": {"type": name}})
    message = problem.message
    assert f'did you mean "{meant}"?' in message


# (d) ZeRO knobs of another stage ---------------------------------------------------------------------------------

STAGE3_ONLY = sorted(k for k, stages in READ_AT.items() if stages == (3,))


@pytest.mark.parametrize("key", STAGE3_ONLY)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero3_knobs_below_stage3_warn_with_key_stage_and_fix(key, stage):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": stage, key: {} if "offload" in key or key ==
                                                        "leaf_module" else 1}}
    found = {p.path: p for p in check_rules(cfg, world_size=8)}
    problem = found[f"$.zero_optimization.{key}"]
    assert problem.severity == WARNING
    assert f'"{key}" is read only at ZeRO stage 3, but "stage" is {stage}' in problem.message
    assert f'remove "{key}", or set "stage": 3' in problem.message
    assert check_rules({**cfg, "zero_optimization": {**cfg["zero_optimization"], "stage": 3}}, world_size=8) == []


def test_stage3_knob_without_stage_says_the_default():
    [p] = check_rules({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_parameters": 1e9}}, world_size=8)
    assert '"stage" is 0 (not set: DeepSpeed\'s default)' in p.message


@pytest.mark.parametrize("key", ["round_robin_gradients", "use_multi_rank_bucket_allreduce", "parameter_alignment",
                                 "ignore_unused_parameters", "allgather_bucket_size"])
def test_zero12_knobs_at_stage3_warn(key):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, key: True}}
    [p] = check_rules(cfg, world_size=8)
    assert p.path == f"$.zero_optimization.{key}" and p.severity == WARNING and '"stage" is 3' in p.message


@pytest.mark.parametrize("key", ["reduce_bucket_size", "contiguous_gradients", "reduce_scatter",
                                 "load_from_fp32_weights", "round_robin_gradients"])
def test_zero_knobs_at_stage0_warn(key):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 0, key: True}}
    [p] = check_rules(cfg, world_size=8)
    assert p.severity == WARNING and '"stage" is 0' in p.message and f'remove "{key}"' in p.message


def test_knobs_every_stage_reads_do_not_warn():
    for stage in range(4):
        zero = {"stage": stage, "overlap_comm": True, "allgather_partitions": True, "elastic_checkpoint": False}
        assert check_rules({"train_batch_size": 8, "zero_optimization": zero}, world_size=8) == []


def test_offload_param_with_a_device_below_stage3_stays_one_error():
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    [p] = check_rules(cfg, world_size=8)
    assert p.severity == ERROR and '"offload_param" to cpu needs "stage" >= 3' in p.message


def test_offload_optimizer_superoffload_knobs_below_stage3_warn():
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.5}}}
    assert {p.path for p in check_rules(cfg, world_size=8) if p.severity == WARNING} == {
        "$.zero_optimization.offload_optimizer.super_offload",
        "$.zero_optimization.offload_optimizer.cpuadam_cores_perc"}


def test_zero_allow_untested_optimizer_at_stage0_warns():
    [p] = check_rules({"train_batch_size": 8, "zero_allow_untested_optimizer": True}, world_size=8)
    assert p.path == "$.zero_allow_untested_optimizer" and p.severity == WARNING


@pytest.mark.parametrize("cfg, path, words", [
    ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}}, "$.zero_optimization.compute_grad_norm",
     ['"stage" is 3', "DeepSpeed refuses"]),
    ({"zero_optimization": {"stage": 0, "compute_grad_norm": False}}, "$.zero_optimization.compute_grad_norm",
     ['"stage" is 0']),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "$.zero_optimization.offload_optimizer.ratio", ['"ratio" 0.3 < 1', '"stage" is 2', 'set "stage": 3']),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "$.gradient_allreduce_op", ['"sum"']),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "$.fp16.fp16_master_weights_and_grads", ['"stage" is 0']),
    ({"bf16": {"bf16_master_weights_and_grads": True}}, "$.bf16.bf16_master_weights_and_grads", ["asserts"]),
    ({"bf16": {"bf16_optimizer_states": True}}, "$.bf16.bf16_optimizer_states", ["asserts"]),
])
def test_stage_combinations_deepspeed_refuses_are_errors(cfg, path, words):
    problem = by_severity({"train_batch_size": 8, **cfg}, ERROR)[path]
    for word in words:
        assert word in problem.message, problem.message


def test_unknown_stage_skips_the_stage_rules():
    for stage in ("auto", "2", None):
        cfg = {"train_batch_size": 8, "zero_optimization": {"stage": stage, "stage3_max_live_parameters": 1}}
        assert [p for p in check_rules(cfg, world_size=8) if p.severity == WARNING] == []
