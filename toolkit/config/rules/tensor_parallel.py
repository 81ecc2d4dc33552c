"""Rules for tensor parallelism ("tensor_parallel": {"autotp_size": N}, DeepSpeed 0.19's AutoTP), for a
config alone (`tensor_parallel_problems`, run by rules.check_rules) and for a config with its model
(`model_problems`, run by `dstk validate --model`).

What DeepSpeed 0.19 does and does not combine with AutoTP (line numbers in site-packages/deepspeed/):
- train_batch_size is checked against mbs * gas * WORLD size, not dp (runtime/config.py:471 takes the
  world size, :602 asserts): the config is parsed before the tp groups exist. Configs for tp > 1 give
  mbs and gas only.
- A PipelineEngine's mesh ignores the pipe axis: engine.py:957-958 replaces the grid's mpu with a
  (world/tp, tp) mesh, so "dp" becomes pairs of pipeline stages and the model broadcast fails. With
  pp > 1 dstk train therefore hands DeepSpeed no "tensor_parallel" section and shards each stage's
  blocks itself over the grid's tp axis (toolkit.distributed.tensor_parallel); pipelines keep ZeRO 0-1.
- ZeRO 0-3 all train (engine.py:952-955 says stage 3 is supported). Under ZeRO-3 a tp shard is partitioned
  over its dp ranks and a tensor the tp ranks share over the whole world (zero.Init's group); dstk's export
  gathers both (toolkit.checkpoint.state._zero3_tensor_parallel_state).
- Offload: nothing in _configure_tensor_parallel / _apply_autotp_partitioning (engine.py:940-1200) or
  the ZeRO optimizers reads the tp size against offload, so DeepSpeed does not refuse it; dstk has not
  run it (a NOTE).
- tensor_parallel.tp.tp_size must be 1 or autotp_size (engine.py:1020-1022 raises otherwise).
"""

from toolkit.config.problems import NOTE, Problem

TP = "$.tensor_parallel.autotp_size"


def _section(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    return value if isinstance(value, dict) else {}


def tensor_parallel_problems(cfg: dict, ctx) -> list[Problem]:
    """Problems of a config with tp = ctx.tp > 1 (rules.Context: world_size, pp, tp)."""
    if ctx.tp <= 1:
        return []
    problems = []
    problems += _batch_key(cfg, ctx)
    zero = _section(cfg, "zero_optimization")
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if _section(zero, k).get("device") not in (None, "none")]
    if offloaded:
        problems.append(Problem(f"$.zero_optimization.{offloaded[0]}", f'"{offloaded[0]}" with "autotp_size" '
                                f"{ctx.tp}: DeepSpeed 0.19 does not refuse offload with AutoTP (nothing in "
                                "engine.py _configure_tensor_parallel reads it), but dstk has not tested the "
                                "combination", NOTE))
    inner = _section(_section(cfg, "tensor_parallel"), "tp").get("tp_size")
    if isinstance(inner, int) and not isinstance(inner, bool) and inner not in (1, ctx.tp):
        problems.append(Problem("$.tensor_parallel.tp.tp_size", f'"tp_size" {inner} != "autotp_size" {ctx.tp}: '
                                "DeepSpeed raises at start-up (engine.py:1020-1022); remove \"tp\" or set it to "
                                f"{ctx.tp}"))
    return problems


def _batch_key(cfg: dict, ctx) -> list[Problem]:
    """train_batch_size (a number) with tp > 1: what DeepSpeed checks it against, and what to write."""
    gbs = cfg.get("train_batch_size")
    if isinstance(gbs, bool) or not isinstance(gbs, int):
        return []  # absent, "auto" (the HF Trainer fills world * mbs * gas), or the schema's to report
    mbs, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
    fix = 'remove "train_batch_size" and give "train_micro_batch_size_per_gpu" and "gradient_accumulation_steps"'
    if ctx.world_size is not None and ctx.world_size % (ctx.pp * ctx.tp) == 0:
        dp = ctx.dp
        if isinstance(mbs, int) and mbs > 0 and gbs % (mbs * dp) == 0:
            fix = (f'remove "train_batch_size" and set "gradient_accumulation_steps": {gbs // (mbs * dp)} '
                   f"(gbs {gbs} = mbs({mbs}) * gas({gbs // (mbs * dp)}) * dp({dp}))")
        elif not isinstance(mbs, int) and gbs % dp == 0:
            fix += f" with mbs * gas = {gbs} / dp({dp}) = {gbs // dp}"
    return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} with "autotp_size" {ctx.tp}: DeepSpeed 0.19 '
                    "checks it against mbs * gas * WORLD size (deepspeed/runtime/config.py:471, asserted at :602, "
                    "parsed before the tp groups exist), so a train_batch_size counted over dp = world / tp replicas "
                    "fails at start-up; "
                    f"{fix}; dstk computes gbs = mbs * gas * dp")]


def model_problems(cfg: dict, arch, tp: int) -> list[Problem]:
    """Whether AutoTP can shard `arch` (toolkit.plan.arch.Arch) `tp` ways: a plan, and heads and MLP
    widths that divide."""
    from toolkit.plan.tp import autotp_problems

    section = _section(cfg, "tensor_parallel")
    custom = bool(section.get("preset_model") or section.get("partition_config"))
    return [Problem(TP, message) for message in autotp_problems(arch, tp, custom_plan=custom)]
