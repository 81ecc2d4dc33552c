"""Rules for Ulysses sequence parallelism ("sequence_parallel_size": N, DeepSpeed 0.19's
runtime/sequence_parallel/ulysses_sp.py), for a config alone (`sequence_parallel_problems`, run by
rules.check_rules) and for a config with its model and sequence length (`ulysses_problems`, run by
`dstk validate --model`, `dstk plan` and `dstk train`).

What DeepSpeed 0.19.8 combines with sp and what not (paths in site-packages/deepspeed/):
- Each sp group is sp consecutive ranks (runtime/sequence_parallel/parallel_state_sp.py); they share
  their rows and each holds 1/sp of the sequence, so dp = world / (pp * sp * tp) and train_batch_size
  is checked against mbs * gas * (world / sp) (runtime/config.py:461-469).
- Not with a PipelineModule: deepspeed/__init__.py asserts `mpu is None` on that path, and Ulysses
  needs its mpu. dstk runs sp inside pipeline stages itself (toolkit.distributed.sequence_parallel).
- Not with AutoTP (tensor_parallel.autotp_size > 1): both would own the attention heads.
- UlyssesSPAttentionHF.__init__: num_attention_heads % sp == 0, and num_key_value_heads % sp == 0 or
  sp % num_key_value_heads == 0 (fewer kv heads than sp are replicated); the sequence length must divide
  by sp (UlyssesSPDataLoaderAdapter).
"""

from toolkit.config.problems import Problem

SP = "$.sequence_parallel_size"


def sequence_parallel_problems(cfg: dict, ctx) -> list[Problem]:
    """Problems of a config with sp = ctx.sp > 1 (rules.Context: world_size, pp, tp, sp)."""
    if ctx.sp <= 1:
        return []
    problems = []
    if ctx.tp > 1:
        problems.append(Problem(SP, f'"sequence_parallel_size" {ctx.sp} with "autotp_size" {ctx.tp}: Ulysses and '
                                "AutoTP both split the attention heads and DeepSpeed 0.19 does not combine them; "
                                f'use "autotp_size": 1 with sp {ctx.sp}, or sp 1 with tp {ctx.tp}'))
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    if zero.get("stage") == 3 and zero.get("reduce_scatter") is False:
        problems.append(Problem("$.zero_optimization.reduce_scatter", f'"reduce_scatter": false with ZeRO-3 and sp '
                                f"{ctx.sp}: DeepSpeed 0.19 then averages some gradient buckets over world / sp ranks "
                                "and others over the whole world (stage3.py), so no loss scale makes them one "
                                'process\'s; remove "reduce_scatter" (its default is true)'))
    if ctx.world_size is not None and ctx.world_size % ctx.model_ranks:
        fits = [d for d in range(1, ctx.world_size + 1) if ctx.world_size % (ctx.pp * ctx.tp * d) == 0]
        problems.append(Problem(SP, f"world size {ctx.world_size} is not divisible by {_product(ctx)} = "
                                f"{ctx.model_ranks}: each sp group is {ctx.sp} ranks; use "
                                f'"sequence_parallel_size" one of {", ".join(map(str, fits))}, or a world size '
                                f"that is a multiple of {ctx.model_ranks}"))
    return problems


def _product(ctx) -> str:
    return " * ".join(f"{k}({v})" for k, v in (("pp", ctx.pp), ("sp", ctx.sp), ("tp", ctx.tp)) if k != "tp" or v > 1)


def ulysses_problems(heads: int, kv_heads: int, sp: int, seq_len: int | None = None) -> list[str]:
    """What UlyssesSPAttentionHF needs of a model with `heads` query and `kv_heads` key/value heads
    at sp, and of the sequence length: each message with its numbers and the fix."""
    if sp <= 1:
        return []
    kv_heads = kv_heads or heads
    fits = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    others = f"sp one of {', '.join(map(str, fits))}" if fits else "sp 1 (no sp fits these heads)"
    out = []
    if heads % sp:
        out.append(f"sp {sp} does not divide num_attention_heads {heads}: Ulysses gives each sp rank "
                   f"heads / sp whole heads; use {others}")
    elif kv_heads % sp and sp % kv_heads:
        out.append(f"sp {sp} and num_key_value_heads {kv_heads}: Ulysses needs kv heads divisible by sp, or sp "
                   f"divisible by kv heads (then each kv head is replicated sp / kv_heads times); use {others}")
    if seq_len is not None and seq_len % sp:
        lower, upper = seq_len // sp * sp, (seq_len // sp + 1) * sp
        out.append(f"seq-len {seq_len} is not divisible by sp {sp}: each sp rank holds seq-len / sp tokens; "
                   f"use --seq-len {' or '.join(str(v) for v in (lower, upper) if v > 0)}")
    return out
