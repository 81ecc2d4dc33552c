"""Rules across fields that a schema cannot express, for a given world size and stage count.

Each rule is a plain function (cfg, ctx) -> list[Problem]; `check_rules` runs them all. Values of
the wrong type are skipped here: the schema reports them. "auto" (filled by the HF Trainer /
Accelerate) counts as set but unknown: the schema gives its NOTE (an ERROR under --strict), and a
rule checks only what holds whatever gets filled in. null reads as absent, as in DeepSpeed.
"""

from dataclasses import dataclass

from toolkit.config.problems import NOTE, WARNING, Problem
from toolkit.config.rules.zero_stages import stage_problems
from toolkit.errors import ConfigError
from toolkit.distributed.topology import DEEPSPEED_KEYS as BATCH_KEYS, JSON_KEYS, divisors, resolve_batch, sp_of, tp_of

AUTO = "auto"


@dataclass(frozen=True)
class Context:
    world_size: int | None
    pp: int  # stages: --pp, else pipeline.stages in the file, else 1
    tp: int = 1  # tensor_parallel.autotp_size (toolkit.distributed.topology.tp_of), else 1
    sp: int = 1  # sequence_parallel_size (toolkit.distributed.topology.sp_of), else 1

    @property
    def model_ranks(self) -> int:
        """The ranks one replica spans: pp * sp * tp (dp = world / this)."""
        return self.pp * self.tp * self.sp

    @property
    def dp(self) -> int:
        return self.world_size // self.model_ranks

    def dp_arithmetic(self) -> str:
        extra = "".join(f" * {k}({v})" for k, v in (("sp", self.sp), ("tp", self.tp)) if v > 1)
        model = f"(pp({self.pp}){extra})" if extra else f"pp({self.pp})"
        return f"dp = world({self.world_size}) / {model} = {self.dp}"


def check_rules(cfg: dict, world_size: int | None = None, pp: int | None = None, sp: int | None = None) -> list[Problem]:
    """All cross-field problems of `cfg` for `world_size` processes, `pp` stages and sp (--sp: the
    file's "sequence_parallel_size" must agree)."""
    from toolkit.config.rules.accumulation import accumulation_problems
    from toolkit.config.rules.expert_parallel import expert_parallel_problems
    from toolkit.config.rules.sequence_parallel import sequence_parallel_problems
    from toolkit.config.rules.tensor_parallel import tensor_parallel_problems

    problems, file_pp = _stages(cfg, pp)
    try:
        tp = tp_of(cfg)
    except ConfigError as exc:
        problems.append(Problem("$.tensor_parallel.autotp_size", str(exc)))
        tp = 1
    try:
        file_sp = sp_of(cfg)
    except ConfigError as exc:
        problems.append(Problem("$.sequence_parallel_size", str(exc)))
        file_sp = 1
    if sp is not None and "sequence_parallel_size" in cfg and sp != file_sp:
        problems.append(Problem("$.sequence_parallel_size", f'"sequence_parallel_size" is {file_sp} in the file but '
                                f"--sp is {sp}: the config was made for another layout; regenerate it with --sp {sp}, "
                                "or drop --sp"))
    sp = sp or file_sp
    ctx = Context(world_size, pp or file_pp or 1, tp, sp)
    for rule in (_topology, _batch, _zero_with_pipeline, _timers_with_pipeline, _offload, _zero_stages, _precision, _parts, _profile,
                 _null_types, _jit_built_optimizer, tensor_parallel_problems, sequence_parallel_problems,
                 expert_parallel_problems, accumulation_problems):
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
    if ctx.world_size is None or ctx.world_size % (ctx.pp * ctx.tp) == 0:
        return []
    fits = ", ".join(str(d) for d in divisors(ctx.world_size) if d <= 64)
    if ctx.tp > 1:
        return [Problem("$.tensor_parallel.autotp_size", f"world size {ctx.world_size} is not divisible by pp({ctx.pp}) "
                        f"* tp({ctx.tp}) = {ctx.pp * ctx.tp}; pp * tp must divide the world size (one of {fits}): "
                        f'change "autotp_size" or the world size')]
    return [Problem("$.pipeline.stages", f"world size {ctx.world_size} is not divisible by pp {ctx.pp}; "
                    f"pp must divide the world size (one of {fits})")]


def _batch(cfg: dict, ctx: Context) -> list[Problem]:
    if AUTO in (cfg.get(k) for k in BATCH_KEYS):
        return _batch_with_auto(cfg, ctx)
    gbs, mbs, gas = (_int(cfg.get(k)) for k in BATCH_KEYS)
    if ctx.tp > 1 and gbs is not None:  # refused by tp_rules, which says what to write instead
        if mbs is None:
            return []
        gbs = None
    if gbs is None and mbs is None:
        return [Problem("$", 'set "train_batch_size" or "train_micro_batch_size_per_gpu": DeepSpeed needs one of them')]
    if ctx.world_size is None:
        return _batch_without_world(gbs, mbs, gas, ctx.pp, ctx.sp)
    if ctx.world_size % ctx.model_ranks:
        return []  # reported by _topology or sequence_parallel_problems
    try:
        resolve_batch(ctx.dp, mbs=mbs, gas=gas, gbs=gbs, names=JSON_KEYS)
    except ConfigError as exc:
        return [Problem("$.train_batch_size", f"{exc} ({ctx.dp_arithmetic()})")]
    return []


def _batch_with_auto(cfg: dict, ctx: Context) -> list[Problem]:
    """Some batch key is "auto": the HF Trainer fills mbs and gas from its arguments and gbs as
    world * mbs * gas. Only a fixed "train_batch_size" can still be checked: it must be a multiple of
    dp times the numbers written, whatever fills the "auto" ones."""
    gbs = _int(cfg.get("train_batch_size"))
    if gbs is None:
        if cfg.get("train_batch_size") == AUTO or cfg.get("train_micro_batch_size_per_gpu") == AUTO:
            return []  # one of the two DeepSpeed needs will be filled
        return [Problem("$", 'set "train_batch_size" or "train_micro_batch_size_per_gpu" (a number or "auto"): '
                        'DeepSpeed needs one of them, and "gradient_accumulation_steps": "auto" fills neither')]
    if ctx.world_size is None or ctx.world_size % ctx.model_ranks:
        return []
    dp = ctx.dp
    known = [(k, _int(cfg.get(k))) for k in BATCH_KEYS[1:] if _int(cfg.get(k))]
    per_step = dp
    for _, value in known:
        per_step *= value
    if gbs % per_step == 0:
        return []
    autos = " and ".join(f'"{k}"' for k in BATCH_KEYS[1:] if cfg.get(k) == AUTO)
    factors = " * ".join([f'"{k}"({v})' for k, v in known] + [f"dp({dp})"])
    return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} is not divisible by {factors} = {per_step} '
                    f"({ctx.dp_arithmetic()}): no value the HF Trainer fills into {autos} "
                    f'("auto") fits; set "train_batch_size": "auto", or a multiple of {per_step}')]


def _batch_without_world(gbs, mbs, gas, pp, sp=1) -> list[Problem]:
    """No --world-size: say which world sizes the batch numbers fit (tp = 1: with tp > 1 there is no
    train_batch_size to fit); each replica spans pp * sp ranks."""
    span, named = pp * sp, f"pp({pp}) * sp({sp})" if sp > 1 else f"pp({pp})"
    if gbs and mbs and gas:
        if gbs % (mbs * gas):
            return [Problem("$.train_batch_size", f'"train_batch_size" {gbs} is not divisible by mbs({mbs}) * '
                            f"gas({gas}) = {mbs * gas}: no world size fits; fix one of the three")]
        dp = gbs // (mbs * gas)
        return [Problem("$", f"batch numbers fit exactly one layout: dp = {gbs} / ({mbs} * {gas}) = {dp}, "
                        f"world size = dp({dp}) * {named} = {dp * span}; pass --world-size to check it", NOTE)]
    known = gbs // mbs if gbs and mbs and gbs % mbs == 0 else gbs // gas if gbs and gas and gbs % gas == 0 else None
    if known is None:
        return []
    worlds = [d * span for d in divisors(known)][:12]
    return [Problem("$", f"batch numbers fit world sizes {', '.join(map(str, worlds))} (dp dividing {known}, "
                    f"times {named.replace('(', ' ').replace(')', '')}); pass --world-size to check one", NOTE)]


def _timers_with_pipeline(cfg: dict, ctx: Context) -> list[Problem]:
    """With wall_clock_breakdown, DeepSpeed 0.19's PipelineEngine fails an assertion in its bwd_microstep
    timer at the first backward (dstk logs each stage's forward and backward seconds itself)."""
    if ctx.pp > 1 and cfg.get("wall_clock_breakdown") is True:
        return [Problem("$.wall_clock_breakdown", f'"wall_clock_breakdown": true with {ctx.pp} pipeline stages: '
                        "DeepSpeed's PipelineEngine fails an assertion in its bwd_microstep timer at the first "
                        'backward; remove it (dstk train logs each stage\'s forward and backward seconds in '
                        "metrics.jsonl and --report-to)")]
    return []


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
        if device in (None, "none", AUTO) or stage is None:
            continue  # "auto": Accelerate fills the device from its own config; nothing to check yet
        if stage < need:
            problems.append(Problem(f"$.zero_optimization.{key}", f'"{key}" to {device} needs "stage" >= {need}, '
                                    f'got {stage}: {why}; set "stage": {need} or remove "{key}"'))
        if device == "nvme" and not _section(zero, key).get("nvme_path"):
            problems.append(Problem(f"$.zero_optimization.{key}.nvme_path", f'"{key}" to nvme needs "nvme_path" '
                                    "(a directory on a fast local disk)"))
    return problems


def _zero_stages(cfg: dict, ctx: Context) -> list[Problem]:
    return stage_problems(cfg)  # ZeRO knobs of another stage (zero_stages.py)


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


def _profile(cfg: dict, ctx: Context) -> list[Problem]:
    """"profile" is a measurement, made once by `dstk partition --method profile --config FILE`, which
    records "parts"; training does not time layers itself (every rank must build the same stages, and
    timing needs every layer built on one rank)."""
    section = _section(cfg, "pipeline")
    if ctx.pp == 1 or section.get("partition_method") != "profile" or section.get("parts"):
        return []
    return [Problem("$.pipeline.partition_method", '"partition_method" "profile" without "parts": layer times are '
                    "not measured at train time; time them once and record the split with `dstk partition MODEL "
                    f'--pp {ctx.pp} --method profile --config FILE`, or use "compute" (estimated time per layer)')]


def _null_types(cfg: dict, ctx: Context) -> list[Problem]:
    """"type": null is DeepSpeed's default (get_optimizer_name / get_scheduler_name): no optimizer or
    scheduler is built from the section, and its "params" are never read."""
    problems = []
    for key, what in (("optimizer", "optimizer"), ("scheduler", "scheduler")):
        section = cfg.get(key)
        if isinstance(section, dict) and "type" in section and section["type"] is None:
            unread = ' and ignores its "params"' if section.get("params") else ""
            problems.append(Problem(f"$.{key}.type", f'"type" is null: DeepSpeed builds no {what} from "{key}"{unread} '
                                    f'(the HF Trainer, seeing "{key}", does not build one either); name a type, or '
                                    f'remove "{key}"', WARNING))
    return problems


def _jit_built_optimizer(cfg: dict, ctx: Context) -> list[Problem]:
    """DeepSpeed's own Adam (FusedAdam) and Lamb (FusedLamb) are CUDA ops compiled at the first run
    (runtime/engine.py get_optimizer_configuration): nvcc and CUDA_HOME needed, minutes lost, and a
    failure there only after every rank has loaded the model. Said once, as a NOTE."""
    section = _section(cfg, "optimizer")
    kind, params = section.get("type"), section.get("params")
    params = params if isinstance(params, dict) else {}
    offload = _section(_section(cfg, "zero_optimization"), "offload_optimizer").get("device") not in (None, "none")
    if kind in ("Adam", "AdamW") and params.get("torch_adam") is not True and not offload:
        return [Problem("$.optimizer.params", f'{kind} without "torch_adam": true builds DeepSpeed\'s FusedAdam, a CUDA '
                        "op compiled at the first run (needs nvcc and CUDA_HOME); add \"torch_adam\": true and "
                        "\"fused\": true for torch's fused AdamW, unless FusedAdam is what you want", NOTE)]
    if kind == "Lamb":
        return [Problem("$.optimizer.type", "Lamb is DeepSpeed's FusedLamb, a CUDA op compiled at the first run "
                        "(needs nvcc and CUDA_HOME)", NOTE)]
    return []


__all__ = ["check_rules", "Context"]
