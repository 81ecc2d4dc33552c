"""What `dstk partition` shows: a split's stages with their costs, next to DeepSpeed's splits.

    report = stage_report(load_arch("gpt2"), pp=4, seq_len=512)
    print(format_report(report))      # or json.dumps(report.to_dict())
    stage_report(load_arch("gpt2"), pp=4, seq_len=512, lora=8)   # LoRA r=8: a frozen base

With LoRA the stages' memory counts frozen weights at their weight bytes and only the adapters' gradients
and optimizer states, and the `compute` split balances LoRA's cheaper backward (toolkit.plan.cost.layers).
With a memory limit (`memory_limit`, `dstk partition --gpu-mem`) the `compute` split is the least slowest
stage among the splits whose every stage's memory fits it (toolkit.plan.cost.partition). Each stage shows its
parameters and, for an MoE model, those one token's forward uses (k of E routed experts, shared experts, dense
blocks and the rest).

    stage_report(load_arch("deepseek-v3"), pp=8, seq_len=4096, memory_limit=2 * 2**40)
"""

from dataclasses import asdict, dataclass, field

from toolkit.plan.arch import Arch
from toolkit.plan.lora import param_counts
from toolkit.plan.cost.layers import layer_costs
from toolkit.plan.cost.partition import check_stages, partition_layers, stage_sums

COMPARED = ("parameters", "uniform")  # DeepSpeed's own methods, shown next to dstk's
FLOPS_ONLY = "compute (FLOPs only)"  # the compute split without the memory limit


@dataclass
class Stage:
    stage: int
    first: str  # name of its first layer, e.g. "embed"
    last: str
    layers: int
    blocks: int
    params: int
    active_params: int  # of `params`, those one token's forward uses (all but an MoE block's unrouted experts)
    flops: float  # forward + backward FLOPs per micro-batch
    memory_bytes: int  # model states + activations of the micro-batches 1F1B keeps in flight
    trainable: int  # of `params`, those with gradients and optimizer states (LoRA: the adapters)


@dataclass
class Split:
    method: str
    parts: list
    blocks: list  # transformer blocks per stage
    imbalance: float  # slowest / mean stage, by the weights the chosen method balances
    peak_memory_bytes: int


@dataclass
class PartitionReport:
    model: str
    params: int
    num_layers: int
    pp: int
    seq_len: int
    mbs: int
    precision: str
    method: str
    balanced_by: str  # "compute (FLOPs)", "memory" or "measured time"
    lora_r: int | None = None  # LoRA rank: adapters on every block linear train, the base is frozen
    trainable_params: int = 0  # unique parameters that train: all, or the adapters
    active_params: int = 0  # unique parameters one token's forward uses: all, or (MoE) its top-k experts
    stages: list = field(default_factory=list)
    splits: list = field(default_factory=list)  # dstk's first, then DeepSpeed's
    profiled_on: str | None = None  # method "profile": where the layers were timed ("timed on cpu in fp32")
    memory_limit: int | None = None  # bytes per stage the `compute` split keeps every stage within

    def to_dict(self) -> dict:
        return asdict(self)


def stage_report(arch: Arch, pp: int, seq_len: int, mbs: int = 1, method: str = "compute",
                     precision: str = "bf16", times=None, attention: str = "sdpa",
                     lora: int | None = None, memory_limit: int | None = None) -> PartitionReport:
    """Split `arch` into pp stages with `method` and compare with DeepSpeed's splits. `lora`: the rank of
    LoRA adapters on every block linear, the base frozen (None: full fine-tuning). `memory_limit`: bytes a
    stage may hold (method "compute" only)."""
    costs = layer_costs(arch, seq_len, mbs, precision, attention, lora=lora)
    check_stages(len(costs), pp)
    memory = _stage_memory(costs, pp)
    per_stage, balanced_by = _balanced_quantity(costs, method, times, memory)
    parts = partition_layers(costs, pp, method, times=times, memory_limit=memory_limit)
    if memory_limit is not None and method == "compute":
        peak = max(memory(s, costs[parts[s]:parts[s + 1]]) for s in range(pp))
        balanced_by += (f" within {_gib(memory_limit)} per stage" if peak <= memory_limit else
                        f": no split keeps every stage within {_gib(memory_limit)}, so the memory split instead")
    params, trainable = param_counts(arch, lora)
    report = PartitionReport(arch.name, params, len(costs), pp, seq_len, mbs, precision, method, balanced_by,
                             lora, trainable, params - arch.inactive_params(), memory_limit=memory_limit)
    if method == "profile" and hasattr(times, "describe"):  # toolkit.plan.cost.profile.LayerTimes
        report.profiled_on = times.describe()
    for s in range(pp):
        chunk = costs[parts[s]:parts[s + 1]]
        held = sum(c.params for c in chunk)
        report.stages.append(Stage(s, chunk[0].name, chunk[-1].name, len(chunk),
                                   sum(c.kind == "block" for c in chunk), held,
                                   held - sum(c.inactive for c in chunk), sum(c.flops for c in chunk),
                                   memory(s, chunk), sum(c.trainable for c in chunk)))
    # with a memory limit, what it costs: the FLOPs split and the memory split beside the one within the limit
    ends = [FLOPS_ONLY, "memory"] if memory_limit is not None and method == "compute" else []
    for name in [method] + ends + [m for m in COMPARED if m != method]:
        p = parts if name == method else partition_layers(costs, pp, name.split()[0])
        blocks = stage_sums([c.kind == "block" for c in costs], p)
        peak = max(memory(s, costs[p[s]:p[s + 1]]) for s in range(pp))
        values = per_stage(p)
        report.splits.append(Split(name, p, blocks, max(values) / (sum(values) / pp), peak))
    return report


def _balanced_quantity(costs, method, times, memory):
    """(parts -> per-stage values, label) of what `method` balances: time, memory or FLOPs."""
    if method == "profile" and times is not None:
        return (lambda p: stage_sums(list(times), p)), "measured time"
    if method == "memory":
        return (lambda p: [memory(s, costs[p[s]:p[s + 1]]) for s in range(len(p) - 1)]), "memory"
    return (lambda p: stage_sums([c.flops for c in costs], p)), "compute (FLOPs)"


def _stage_memory(costs, pp):
    def memory(stage, chunk):
        return sum(c.memory(in_flight=pp - stage) for c in chunk)  # 1F1B with >= pp micro-batches

    return memory


def format_report(r: PartitionReport) -> str:
    """Human-readable table of the report."""
    moe = r.active_params != r.params
    active = f" ({_si(r.active_params)} active per token)" if moe else ""
    lines = [f"{r.model}: {_si(r.params)} parameters{active}, {r.num_layers} pipeline layers, "
             f"seq {r.seq_len} x mbs {r.mbs}, {r.precision}, pp {r.pp}; method {r.method!r}",
             *([f"LoRA r={r.lora_r} on every block linear: {_si(r.trainable_params)} trainable parameters "
                f"({r.trainable_params / r.params:.2%}); the base is frozen"] if r.lora_r else []),
             f"{'stage':>5}  {'layers':<22}{'blocks':>6}  {'params':>8}  " + (f"{'active':>8}  " if moe else "")
             + f"{'fwd+bwd':>10}  {'share':>6}  {'memory':>9}"]
    total = sum(s.flops for s in r.stages) or 1.0
    for s in r.stages:
        span = s.first if s.layers == 1 else f"{s.first} .. {s.last}"
        lines.append(f"{s.stage:>5}  {span:<22}{s.blocks:>6}  {_si(s.params):>8}  "
                     + (f"{_si(s.active_params):>8}  " if moe else "")
                     + f"{_si(s.flops) + 'FLOP':>10}  {100 * s.flops / total:>5.1f}%  {_gib(s.memory_bytes):>9}")
    states = ("frozen weights + the adapters' weights, gradients and optimizer states" if r.lora_r else
              "parameter, gradient and optimizer states")
    lines += ["", f"slowest/mean stage by {r.balanced_by}"
              + (f" ({r.profiled_on})" if r.profiled_on else "")
              + f"; memory = {states} + activations of pp - s micro-batches in flight (1F1B) + the loss's peak"]
    limited = r.memory_limit is not None and r.method == "compute" and r.splits[0].peak_memory_bytes <= r.memory_limit
    rows = [(("deepspeed " if sp.method in COMPARED else "dstk ") + sp.method + (" within the limit" if i == 0 and
                                                                                 limited else ""),
             str(sp.parts), str(sp.blocks), f"{sp.imbalance:.3f}", _gib(sp.peak_memory_bytes))
            for i, sp in enumerate(r.splits)]
    header = ("split", "parts", "blocks per stage", "slowest/mean", "peak memory")
    widths = [max(len(row[k]) for row in rows + [header]) for k in range(len(header))]
    for row in [header] + rows:
        lines.append("  ".join(cell.ljust(w) if k < 3 else cell.rjust(w)
                               for k, (cell, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
