"""What `dstk generate-config` is asked for: one typed object, checked as a whole.

`GenerateOptions.check()` collects EVERY problem before raising (like litgpt's validate_args), each
naming the flag, the numbers and the fix. `toolkit.config.generate.build_config` turns a checked
object into a DeepSpeed config dict.
"""

import math
from dataclasses import dataclass, field

from toolkit.errors import ConfigError
from toolkit.distributed.topology import Batch, Topology, resolve_batch

STRATEGIES = ("dp", "pp", "hybrid")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Lamb", "Adagrad", "none")
# DeepSpeed's lr_schedules.VALID_LR_SCHEDULES, and none
SCHEDULERS = ("none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MONITORS = ("tensorboard", "csv", "wandb")
PARTITION_METHODS = ("compute", "memory", "profile", "parameters", "uniform")
MAX_PROCESSES = 2**20  # world size, nodes, GPUs per node, stages: beyond any cluster; bounds divisor searches
MAX_COUNT = 2**31 - 1  # batch sizes and step counts: beyond any run; larger numbers are typos
MAX_SCALE_POWER = 127  # 2**128 overflows fp32, where DeepSpeed keeps the loss scale


@dataclass
class GenerateOptions:
    # topology
    strategy: str | None = None  # dp / pp / hybrid; inferred from pp and dp when None
    world_size: int | None = None  # total processes (GPUs); or nodes * gpus_per_node
    nodes: int | None = None
    gpus_per_node: int | None = None
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel size (DeepSpeed AutoTP; inside pipeline stages too): tensor_parallel.autotp_size
    sp: int = 1  # Ulysses sequence-parallel size (any pp, tp = 1): sequence_parallel_size
    ep: int = 1  # expert-parallel size (DeepSpeed AutoEP, inside dp): expert_parallel.autoep_size
    ep_preset: str | None = None  # AutoEP preset naming the MoE modules (expert_parallel.preset_model); None: tries each
    partition_method: str = "compute"  # how layers are split into stages (or "type:REGEX")
    # batch: gbs = mbs * gas * dp; one of gbs / gas may be None and is derived
    mbs: int = 1
    gbs: int | None = None
    gas: int | None = None
    # memory and precision
    zero: int | None = None  # None: 1 under bf16 (DeepSpeed sums gradients in fp32 only at ZeRO >= 1), else 0
    precision: str = "fp32"
    loss_scale: float = 0.0  # fp16 only; 0 = dynamic loss scaling
    initial_scale_power: int = 16  # fp16 dynamic scaling starts at 2**power
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    activation_checkpointing: bool = False
    # optimization
    optimizer: str = "AdamW"
    fused_adam: bool = False  # Adam/AdamW: DeepSpeed's FusedAdam (JIT-built, needs nvcc) instead of torch's
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.0  # SGD only
    scheduler: str = "none"
    warmup_steps: int = 0
    total_steps: int | None = None
    warmup_min_lr: float = 0.0
    gradient_clipping: float | None = 1.0
    # logging
    monitors: tuple[str, ...] = ()
    monitor_dir: str = "runs/monitor"
    job_name: str = "dstk"
    steps_per_print: int = 10
    # modes
    hf: bool = False  # write "auto" where the HF Trainer / Accelerate fill values
    cpu: bool = False  # avoid ops that need a JIT build on CPU-only machines
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.zero is None:
            self.zero = 1 if self.precision == "bf16" else 0

    def topology(self) -> Topology:
        return Topology(self.resolved_world_size(), self.pp, self.tp, self.sp)

    def resolved_world_size(self) -> int:
        if self.world_size is not None:
            return self.world_size
        if self.nodes is not None and self.gpus_per_node is not None:
            return self.nodes * self.gpus_per_node
        return self.pp * self.tp * self.sp  # pure pipeline (or one tp/sp group): one process per stage and shard

    def batch(self) -> Batch:
        return resolve_batch(self.topology().dp, mbs=self.mbs, gas=self.gas, gbs=self.gbs)

    def check(self) -> tuple[Topology, Batch]:
        """Every rule at once; raises one ConfigError listing all problems."""
        problems = []
        topo = batch = None
        problems += _check_sizes(self)
        if not problems:
            try:
                topo = self.topology()
                batch = self.batch()
            except ConfigError as exc:
                problems.append(str(exc))
        if batch is not None:
            problems += _check_batch_size(batch)
        if not problems and self.sp > 1:
            problems += _check_sequence_parallel(self)
        if not problems and (self.ep > 1 or self.ep_preset):
            problems += _check_expert_parallel(self)
        if topo is not None:
            problems += _check_strategy(self, topo)
        problems += _check_memory(self)
        problems += _check_precision(self)
        problems += _check_optimization(self)
        if problems:
            bullet = "\n  - "
            raise ConfigError(f"{len(problems)} problem(s):{bullet}{bullet.join(problems)}" if len(problems) > 1 else problems[0])
        return topo, batch


def _positive(name, value, minimum=1, maximum=MAX_COUNT, why="more than any real run uses"):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        return [f"{name} must be an integer >= {minimum}, got {value!r}"]
    if value is not None and value > maximum:
        return [f"{name} {value} is {why} (at most {maximum}); check for extra digits"]
    return []


def _real(name, value, minimum=0.0, above=False):
    """A finite float >= minimum (> minimum when above): NaN and inf pass `<` checks silently."""
    if value is None:
        return []
    if not math.isfinite(value):
        return [f"{name} must be a finite number, got {value}; JSON has no NaN or Infinity"]
    if value < minimum or (above and value == minimum):
        return [f"{name} must be {'>' if above else '>='} {minimum:g}, got {value:g}"]
    return []


def _check_sizes(o: GenerateOptions) -> list[str]:
    problems = []
    for flag, value in (("--world-size", o.world_size), ("--nodes", o.nodes), ("--gpus-per-node", o.gpus_per_node),
                        ("--pp", o.pp), ("--tp", o.tp), ("--sp", o.sp), ("--ep", o.ep)):
        problems += _positive(flag, value, maximum=MAX_PROCESSES, why="more processes than any cluster has")
    for flag, value in (("--mbs", o.mbs), ("--gbs", o.gbs), ("--gas", o.gas), ("--steps-per-print", o.steps_per_print)):
        problems += _positive(flag, value)
    if (o.nodes is None) != (o.gpus_per_node is None):
        problems.append("--nodes and --gpus-per-node go together; give both, or --world-size alone")
    elif o.nodes is not None and not problems and o.nodes * o.gpus_per_node > MAX_PROCESSES:
        problems.append(f"--nodes({o.nodes}) * --gpus-per-node({o.gpus_per_node}) = {o.nodes * o.gpus_per_node} "
                        f"processes is more than any cluster has (at most {MAX_PROCESSES}); check for extra digits")
    elif o.world_size is not None and o.nodes is not None and o.world_size != o.nodes * o.gpus_per_node:
        problems.append(f"--world-size {o.world_size} != --nodes({o.nodes}) * --gpus-per-node({o.gpus_per_node}) = "
                        f"{o.nodes * o.gpus_per_node}; give one or the other")
    if o.strategy in ("dp", "hybrid") and o.world_size is None and o.nodes is None:
        problems.append(f"--strategy {o.strategy} needs --world-size N (or --nodes and --gpus-per-node)")
    return problems


def _check_sequence_parallel(o: GenerateOptions) -> list[str]:
    """sp's refusals, as `dstk validate` words them (toolkit.config.rules.sequence_parallel), with flags."""
    from types import SimpleNamespace

    from toolkit.config.rules.sequence_parallel import sequence_parallel_problems

    ctx = SimpleNamespace(world_size=None, pp=o.pp, tp=o.tp, sp=o.sp, model_ranks=o.pp * o.tp * o.sp)
    words = (('"sequence_parallel_size" ', "--sp "), ('"autotp_size" ', "--tp "), ('"autotp_size": 1', "--tp 1"))
    out = []
    for problem in sequence_parallel_problems({}, ctx):
        message = problem.message
        for old, new in words:
            message = message.replace(old, new)
        out.append(message)
    return out


def _check_expert_parallel(o: GenerateOptions) -> list[str]:
    """AutoEP's refusals, as `dstk validate` words them (toolkit.config.rules.expert_parallel), with flags."""
    from types import SimpleNamespace

    from toolkit.config.rules.expert_parallel import PRESETS, expert_parallel_problems, expert_parallel_section

    if o.ep_preset is not None and o.ep_preset not in PRESETS:
        return [f"--ep-preset {o.ep_preset!r} is not one of DeepSpeed's AutoEP presets: {', '.join(PRESETS)}"]
    cfg = {"expert_parallel": expert_parallel_section(o.ep, o.ep_preset), "zero_optimization": {
        "stage": o.zero, **{k: {"device": d} for k, d in (("offload_optimizer", o.offload_optimizer),
                                                            ("offload_param", o.offload_param)) if d != "none"}}}
    if o.gradient_clipping is not None:
        cfg["gradient_clipping"] = o.gradient_clipping
    ctx = SimpleNamespace(world_size=o.resolved_world_size(), pp=o.pp, tp=o.tp, sp=o.sp)
    words = (('"autoep_size" ', "--ep "), ('"autotp_size": 1', "--tp 1"), ('"autotp_size" ', "--tp "),
             ('"sequence_parallel_size" ', "--sp "), ('"stage" 0', "--zero 0"), ('"stage": 1', "--zero 1"),
             ('"gradient_clipping": 0', "--grad-clip 0"), ('"gradient_clipping" ', "--grad-clip "), ('remove "offload_optimizer"', "use --offload-optimizer none"),
             ('remove "offload_param"', "use --offload-param none"),
             ('"offload_optimizer" ', f"--offload-optimizer {o.offload_optimizer} "),
             ('"offload_param" ', f"--offload-param {o.offload_param} "))
    out = []
    for problem in expert_parallel_problems(cfg, ctx):
        message = problem.message
        for old, new in words:
            message = message.replace(old, new)
        out.append(message + ("" if o.world_size or o.nodes else f"; or give --world-size N, a multiple of pp * ep = "
                                                                  f"{o.pp * o.ep}"))
    return out


def _check_batch_size(batch: Batch) -> list[str]:
    if batch.gbs > MAX_COUNT:
        return [f"global batch {batch.describe()} is more than any real run uses (at most {MAX_COUNT}); "
                "lower --mbs, --gas or --gbs"]
    return []


def _check_strategy(o: GenerateOptions, topo: Topology) -> list[str]:
    problems = []
    if o.strategy == "dp" and topo.pp != 1:
        problems.append(f"--strategy dp means pp = 1, but --pp is {topo.pp}; use --strategy hybrid for dp x pp")
    if o.strategy == "pp" and topo.dp != 1:
        problems.append(f"--strategy pp means dp = 1, but world({topo.world_size}) / pp({topo.pp}) = dp({topo.dp}); "
                        f"use --strategy hybrid, or --world-size {topo.pp}")
    if o.strategy == "pp" and topo.pp == 1:
        problems.append("--strategy pp needs --pp >= 2")
    if o.strategy == "hybrid" and (topo.pp == 1 or topo.dp == 1):
        problems.append(f"--strategy hybrid needs pp > 1 and dp > 1, got {topo.describe()}; "
                        f"use --strategy {'dp' if topo.pp == 1 else 'pp'} or change --pp/--world-size")
    if o.hf and topo.pp > 1:
        problems.append(f"--hf (HF Trainer/Accelerate) cannot drive a pipeline; got pp={topo.pp}. Drop --hf or use --pp 1")
    method = o.partition_method
    if method not in PARTITION_METHODS and not method.startswith("type:"):
        problems.append(f"--partition-method {method!r} is not one of {', '.join(PARTITION_METHODS)} or type:REGEX")
    if method == "profile" and topo.pp > 1:  # training refuses it without parts (toolkit.config.rules._profile)
        problems.append("--partition-method profile needs measured layer times, which generate-config does not take: "
                        "generate with --partition-method compute, then time the layers and record the split with "
                        f"`dstk partition MODEL --pp {topo.pp} --method profile --config FILE`")
    return problems


def _check_memory(o: GenerateOptions) -> list[str]:
    problems = []
    if o.zero not in (0, 1, 2, 3):
        problems.append(f"--zero must be 0, 1, 2 or 3, got {o.zero}")
    for flag, device in (("--offload-optimizer", o.offload_optimizer), ("--offload-param", o.offload_param)):
        if device not in OFFLOAD_DEVICES:
            problems.append(f"{flag} must be one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}")
    if o.zero >= 2 and o.pp > 1:
        problems.append(f"--zero {o.zero} with pp={o.pp}: DeepSpeed's PipelineEngine refuses ZeRO stage 2/3; "
                        f"use --zero 1 (or 0) with pipelines, or --pp 1")
    if o.offload_param != "none" and o.zero != 3:
        problems.append(f"--offload-param {o.offload_param} needs --zero 3 (got --zero {o.zero}); "
                        "DeepSpeed offloads parameters only in stage 3")
    if o.offload_optimizer != "none" and o.zero < 1:
        problems.append(f"--offload-optimizer {o.offload_optimizer} needs --zero >= 1 (got --zero 0); "
                        "DeepSpeed silently ignores it at stage 0")
    if "nvme" in (o.offload_optimizer, o.offload_param) and not o.nvme_path:
        problems.append("offloading to nvme needs --nvme-path DIR (a fast local disk)")
    if o.cpu and "none" != o.offload_optimizer:
        problems.append(f"--cpu with --offload-optimizer {o.offload_optimizer}: offload uses DeepSpeedCPUAdam, "
                        "an op built by JIT (minutes); drop one of them")
    return problems


def _check_precision(o: GenerateOptions) -> list[str]:
    problems = []
    if o.precision not in PRECISIONS:
        problems.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {o.precision!r}")
    if o.cpu and o.precision == "fp16":
        problems.append("--cpu with fp16: DeepSpeed's CPU accelerator rejects fp16 on most CPUs; use --precision bf16 or fp32")
    fp16_only = {"--loss-scale": (o.loss_scale, 0.0), "--initial-scale-power": (o.initial_scale_power, 16),
                 "--loss-scale-window": (o.loss_scale_window, 1000), "--hysteresis": (o.hysteresis, 2),
                 "--min-loss-scale": (o.min_loss_scale, 1.0)}
    if o.precision != "fp16":
        changed = [flag for flag, (value, default) in fp16_only.items() if value != default]
        if changed:
            problems.append(f"{', '.join(changed)} only apply to fp16 (precision is {o.precision}); add --precision fp16 or drop them")
    else:
        problems += _real("--loss-scale (0 = dynamic)", o.loss_scale)
        problems += _real("--min-loss-scale", o.min_loss_scale, above=True)
        problems += _positive("--initial-scale-power", o.initial_scale_power, 0, MAX_SCALE_POWER,
                              why="too large: 2**128 overflows fp32, where DeepSpeed keeps the scale")
        problems += _positive("--loss-scale-window", o.loss_scale_window) + _positive("--hysteresis", o.hysteresis)
    return problems


def _check_optimization(o: GenerateOptions) -> list[str]:
    problems = []
    if o.optimizer not in OPTIMIZERS:
        problems.append(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {o.optimizer!r}")
    if o.fused_adam and (o.optimizer not in ("Adam", "AdamW") or o.cpu or o.offload_optimizer != "none"):
        why = ("--cpu: FusedAdam is a CUDA op" if o.cpu else f"--offload-optimizer {o.offload_optimizer} uses "
               "DeepSpeedCPUAdam" if o.offload_optimizer != "none" else f"--optimizer {o.optimizer} is not Adam/AdamW")
        problems.append(f"--fused-adam picks DeepSpeed's FusedAdam for Adam/AdamW on GPUs, but {why}; drop --fused-adam")
    if o.cpu and o.optimizer == "Lamb":
        problems.append("--cpu with --optimizer Lamb: Lamb (FusedLamb) is not implemented on DeepSpeed's CPU backend; use AdamW")
    problems += _real("--lr", o.lr, above=True) + _real("--eps", o.eps) + _real("--weight-decay", o.weight_decay)
    problems += _real("--momentum", o.momentum) + _real("--warmup-min-lr", o.warmup_min_lr)
    problems += _real("--grad-clip (0 = off)", o.gradient_clipping)
    if not all(0 <= b < 1 for b in o.betas):
        problems.append(f"--betas must both be in [0, 1), got {o.betas}")
    if o.scheduler not in SCHEDULERS:
        problems.append(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {o.scheduler!r}")
    if o.scheduler == "WarmupCosineLR" and math.isfinite(o.lr) and o.lr > 0 and o.warmup_min_lr > o.lr:
        problems.append(f"--warmup-min-lr {o.warmup_min_lr:g} exceeds --lr {o.lr:g}: WarmupCosineLR writes their "
                        "ratio, which DeepSpeed expects in [0, 1]; lower --warmup-min-lr")
    if o.scheduler in ("WarmupDecayLR", "WarmupCosineLR") and not o.total_steps and not o.hf:
        problems.append(f"--scheduler {o.scheduler} needs --total-steps N (the step at which the decay ends)")
    steps = _positive("--warmup-steps", o.warmup_steps, 0) + _positive("--total-steps", o.total_steps)
    problems += steps
    if not steps and o.total_steps is not None and o.total_steps <= o.warmup_steps:
        problems.append(f"--total-steps {o.total_steps} must exceed --warmup-steps {o.warmup_steps}")
    if o.scheduler == "OneCycle" and o.warmup_steps < 1:
        problems.append("--scheduler OneCycle needs --warmup-steps >= 1 (the length of the rising half of the cycle)")
    if o.scheduler == "LRRangeTest" and o.warmup_steps < 1:
        problems.append("--scheduler LRRangeTest needs --warmup-steps >= 1 (the steps between lr increases)")
    bad_monitors = [m for m in o.monitors if m not in MONITORS]
    if bad_monitors:
        problems.append(f"--monitor {bad_monitors[0]!r} is not one of {', '.join(MONITORS)}")
    return problems
