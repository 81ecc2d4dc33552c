"""Rules across fields that a schema cannot express, for a given world size and stage count.

Each rule is a plain function (cfg, ctx) -> list[Problem]; `check_rules` runs them all. Values that
are "auto" (filled by the HF Trainer) or of the wrong type are skipped here: the schema reports them.
"""

from dataclasses import dataclass

from toolkit.config.problems import NOTE, Problem
from toolkit.topology import divisors

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class Context:
    world_size: int | None
    pp: int  # stages: --pp, else pipeline.stages in the file, else 1


def check_rules(cfg: dict, world_size: int | None = None, pp: int | None = None) -> list[Problem]:
    """All cross-field problems of `cfg` for `world_size` processes and `pp` stages."""
    problems, file_pp = _stages(cfg, pp)
    ctx = Context(world_size, pp or file_pp or 1)
    for rule in (_topology, _batch, _zero_with_pipeline, _offload, _precision, _parts):
        problems += rule(cfg, ctx)
    return problems


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _section(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    return value if isinstance(value, dict) else {}


def _stages(cfg: dict, pp: int | None) -> tuple[list[Problem], int | None]:
    file_pp = _int(_section(cfg, "pipeline").get("stages"))
    if pp is not None and file_pp is not None and pp != file_pp:
        return [Problem("$.pipeline.stages", f'"stages" is {file_pp} in the file but --pp is {pp}: the config was '
                        f"made for another topology; regenerate it with --pp {pp}, or drop --pp")], file_pp
    return [], file_pp


def _topology(cfg: dict, ctx: Context) -> list[Problem]:
    if ctx.world_size is None or ctx.world_size % ctx.pp == 0:
        return []
    fits = ", ".join(str(d) for d in divisors(ctx.world_size) if d <= 64)
    return [Problem("$.pipeline.stages", f"world size {ctx.world_size} is not divisible by pp {ctx.pp}; "
                    f"pp must divide the world size (one of {fits})")]


def _batch(cfg: dict, ctx: Context) -> list[Problem]:
    gbs, mbs, gas = (_int(cfg.get(k)) for k in BATCH_KEYS)
    if all(cfg.get(k) == "auto" for k in BATCH_KEYS if k in cfg) and any(k in cfg for k in BATCH_KEYS):
        return []
    if gbs is None and mbs is None:
        return [Problem("$", 'set "train_batch_size" or "train_micro_batch_size_per_gpu": DeepSpeed needs one of them')]
    if ctx.world_size is None:
        return _batch_without_world(gbs, mbs, gas, ctx.pp)
    if ctx.world_size % ctx.pp:
        return []  # reported by _topology
    dp = ctx.world_size // ctx.pp
    where = f"dp = world({ctx.world_size}) / pp({ctx.pp}) = {dp}"
    if gbs and mbs and gas and gbs != mbs * gas * dp:
        return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} != "train_micro_batch_size_per_gpu"({mbs}) * '
                        f'"gradient_accumulation_steps"({gas}) * dp({dp}) = {mbs * gas * dp} ({where}); set '
                        f'"train_batch_size": {mbs * gas * dp}, or regenerate for this world size')]
    if gbs and mbs and not gas and gbs % (mbs * dp):
        return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} is not divisible by '
                        f'"train_micro_batch_size_per_gpu"({mbs}) * dp({dp}) = {mbs * dp} ({where}); DeepSpeed would '
                        f'derive gradient_accumulation_steps = {gbs} // {mbs * dp} = {gbs // (mbs * dp)} and fail')]
    if gbs and gas and not mbs and gbs % (gas * dp):
        return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} is not divisible by '
                        f'"gradient_accumulation_steps"({gas}) * dp({dp}) = {gas * dp} ({where})')]
    return []


def _batch_without_world(gbs, mbs, gas, pp) -> list[Problem]:
    """No --world-size: say which world sizes the batch numbers fit."""
    if gbs and mbs and gas:
        if gbs % (mbs * gas):
            return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} is not divisible by mbs({mbs}) * '
                            f"gas({gas}) = {mbs * gas}: no world size fits; fix one of the three")]
        dp = gbs // (mbs * gas)
        return [Problem("$", f"batch numbers fit exactly one layout: dp = {gbs} / ({mbs} * {gas}) = {dp}, "
                        f"world size = dp({dp}) * pp({pp}) = {dp * pp}; pass --world-size to check it", NOTE)]
    known = gbs // mbs if gbs and mbs and gbs % mbs == 0 else gbs // gas if gbs and gas and gbs % gas == 0 else None
    if known is None:
        return []
    worlds = [d * pp for d in divisors(known)][:12]
    return [Problem("$", f"batch numbers fit world sizes {', '.join(map(str, worlds))} (dp dividing {known}, "
                    f"times pp {pp}); pass --world-size to check one", NOTE)]


def _zero_with_pipeline(cfg: dict, ctx: Context) -> list[Problem]:
    stage = _section(cfg, "zero_optimization").get("stage")
    if ctx.pp > 1 and isinstance(stage, int) and stage >= 2:
        return [Problem("$.zero_optimization.stage", f'"stage" {stage} with {ctx.pp} pipeline stages: DeepSpeed\'s '
                        f'PipelineEngine refuses ZeRO stage 2/3 at start-up; use "stage": 1 (or 0), or pp = 1')]
    return []


def _offload(cfg: dict, ctx: Context) -> list[Problem]:
    zero = _section(cfg, "zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero.get("stage", 0), int) else None
    problems = []
    for key, need, why in (("offload_param", 3, "parameters are offloaded only in stage 3"),
                           ("offload_optimizer", 1, "DeepSpeed silently ignores it at stage 0")):
        device = _section(zero, key).get("device", "none")
        if device in (None, "none") or stage is None:
            continue
        if stage < need:
            problems.append(Problem(f"$.zero_optimization.{key}", f'"{key}" to {device} needs "stage" >= {need}, '
                                    f'got {stage}: {why}; set "stage": {need} or remove "{key}"'))
        if device == "nvme" and not _section(zero, key).get("nvme_path"):
            problems.append(Problem(f"$.zero_optimization.{key}.nvme_path", f'"{key}" to nvme needs "nvme_path" '
                                    "(a directory on a fast local disk)"))
    return problems


def _precision(cfg: dict, ctx: Context) -> list[Problem]:
    if _section(cfg, "fp16").get("enabled") is True and _section(cfg, "bf16").get("enabled") is True:
        return [Problem("$.bf16.enabled", '"fp16" and "bf16" are both enabled; they are exclusive (DeepSpeed asserts); '
                        "keep one")]
    return []


def _parts(cfg: dict, ctx: Context) -> list[Problem]:
    parts = _section(cfg, "pipeline").get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, int) for p in parts):
        return []
    if len(parts) != ctx.pp + 1:
        return [Problem("$.pipeline.parts", f'"parts" has {len(parts)} boundaries; {ctx.pp} stages need {ctx.pp + 1} '
                        "(first 0, last the number of layers)")]
    if parts[0] != 0 or any(b <= a for a, b in zip(parts, parts[1:])):
        return [Problem("$.pipeline.parts", f'"parts" {parts} must start at 0 and strictly increase (every stage '
                        "holds at least one layer)")]
    return []


__all__ = ["check_rules", "Context"]
