"""A PlanResult as text for a terminal, and its chosen layout as a DeepSpeed config."""

import textwrap

from toolkit.errors import ConfigError
from toolkit.plan.gpus import format_bytes as fb
from toolkit.plan.layouts.planner import PlanResult
from toolkit.plan.layouts.estimate import Estimate

OPTIMIZER_TYPES = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD"}


def render_text(result: PlanResult) -> str:
    r = result.request
    usable = result.fitting[0].capacity if result.fitting else result.closest.capacity
    active = f", {result.active:,} active per token" if result.active != result.params else ""
    lines = [f"{r.model} ({result.params:,} parameters{active}) on {r.nodes} x {r.gpus_per_node} "
             f"{result.gpu.name} ({fb(result.gpu.memory)} each, "
             f"{fb(usable)} usable after a {r.reserve:.0%} reserve for allocator fragmentation); seq {result.seq_len}, "
             f"gbs {r.gbs}, {r.precision}",
             f"{result.considered} layouts considered, {len(result.fitting)} fit.", *result.notes]
    if r.lora:
        lines.insert(1, f"LoRA r={r.lora} on every block linear: {result.trainable:,} trainable of {result.params:,} "
                        f"parameters ({result.trainable / result.params:.2%}); the frozen base holds weights only "
                        f"(no gradients, master weights or optimizer states)")
    for i, (e, why) in enumerate(zip(result.best, result.reasons), 1):
        lines += [""] + _describe(e, f"#{i}") + [f"   why: {why}"]
    if not result.fitting:
        e = result.closest
        over = []
        if e.memory > e.capacity:
            over.append(f"GPU memory by {fb(e.memory - e.capacity)} ({e.memory / e.capacity:.0%} of usable)")
        host = e.states.cpu + e.host_activations
        if host > e.host_capacity:
            over.append(f"host memory by {fb(host - e.host_capacity)} (offloaded {fb(host)} "
                        f"per GPU, --host-mem gives {fb(e.host_capacity)} per GPU)")
        lines += ["", "Nothing fits. Closest:"] + _describe(e, "  ") + [
            f"   exceeds {' and '.join(over)}; use more or larger GPUs, a shorter --seq-len, or a smaller model"]
    return "\n".join(lines)


def _describe(e: Estimate, label: str) -> list:
    s, t = e.states, e.times
    states = (f"params {fb(s.params)}, grads {fb(s.grads)}, master {fb(s.master)}, optimizer {fb(s.optimizer)}"
              + (f", buckets {fb(s.buffers)}" if s.buffers else ""))
    stage = f" (stage {e.stage} of {e.layout.pp})" if e.layout.pp > 1 else ""
    if e.layout.schedule == "dualpipev":
        stage = f" (rank {e.stage} of {e.layout.pp}: stages {e.stage} and {2 * e.layout.pp - 1 - e.stage} of {2 * e.layout.pp})"
    loss = f" (loss peak {fb(e.loss_peak)})" if e.loss_peak else ""
    fixed = (f", fixed {fb(e.fixed.total)} (CUDA context {fb(e.fixed.cuda_context)}, NCCL {e.fixed.communicators} "
             f"x {fb(e.fixed.nccl // e.fixed.communicators)})" if e.fixed.communicators else
             f", fixed {fb(e.fixed.total)} (CUDA context)")
    working = f", ZeRO-3 gathered layers {fb(e.working)}" if e.working else ""
    memory = (f"   memory/GPU {fb(e.memory)}{stage}: model states {fb(s.peak)} ({states}), "
              f"activations {fb(e.activations)}{loss}{working}{fixed}")
    if s.cpu or e.host_activations:
        memory += f"; host {fb(s.cpu + e.host_activations)} offloaded"
        memory += f" (checkpointed activations {fb(e.host_activations)})" if e.host_activations else ""
    comm = (f"   bubble {e.bubble:.1%}, dp comm {fb(e.dp_comm_bytes)}/step/GPU, "
            f"pipeline send/recv {fb(e.pp_comm_bytes)}/step/boundary"
            + (" (DualPipeV: out and back, 2x 1F1B's)" if e.layout.schedule == "dualpipev" else ""))
    if e.layout.tp > 1:
        comm += f", tp comm {fb(e.tp_comm_bytes)}/step/GPU (within a node)"
    if e.layout.ep > 1:
        comm += f", ep all-to-all {fb(e.ep_comm_bytes)}/step/GPU ({_experts(e)})"
    parts = ", ".join(f"{k} {v:.3g}" for k, v in t.items() if v)
    split = textwrap.wrap(f"split {e.parts}, not the FLOPs-balanced {e.flops_parts} whose heaviest stage does not "
                          f"fit: its slowest stage computes {e.split_cost - 1:.1%} more", 116, initial_indent="   ",
                          subsequent_indent="     ") if e.flops_parts else []
    long = [f"   long sequences: {', '.join(e.features)} (dstk train's auto choices)"] if e.features else []
    return [f"{label} {e.layout.describe()}", memory, comm, f"   step ~ {e.step_time:.3g} s ({parts})", *long,
            *_stage_lines(e), *split]


def _experts(e: Estimate) -> str:
    group = e.layout.dp // e.layout.ep
    reduce = f"their gradients reduced over {group} ranks" if group > 1 else "each expert on one rank, none to reduce"
    return f"each rank holds 1/{e.layout.ep} of the experts; {reduce}"


def _stage_lines(e: Estimate) -> list:
    """Per stage: its pipeline layers, parameters (MoE: and of those active per token) and its GPU's memory;
    runs of like stages share a cell."""
    moe = any(s.active_params != s.params for s in e.stages)
    shard = f" (one tp={e.layout.tp} rank's)" if e.layout.tp > 1 else ""
    if len(e.stages) == 1:
        s = e.stages[0]
        return [f"   parameters{shard} {_count(s.params)}"
                + (f", {_count(s.active_params)} active per token" if moe else "")]
    runs = []
    for s in e.stages:
        if runs and (s.last - s.first, s.params, s.active_params) == _shape(runs[-1][-1]):
            runs[-1].append(s)
        else:
            runs.append([s])
    cells = [_run_cell(run, moe) for run in runs]
    what = "parameters (active per token), memory/GPU" if moe else "parameters, memory/GPU"
    return textwrap.wrap(f"stages{shard} [{what}]: " + "; ".join(cells), 116, initial_indent="   ",
                         subsequent_indent="     ", break_on_hyphens=False)


def _shape(s) -> tuple:
    return s.last - s.first, s.params, s.active_params


def _run_cell(run: list, moe: bool) -> str:
    """'0: layers 0-4, 5.94B (1.71B active), 70.7 GiB' or '1-6: 4 layers each, ..., 68.7-69 GiB'."""
    first, last = run[0], run[-1]
    if len(run) == 1:
        where = f"{first.stage}: layer{'s' if first.last - first.first > 1 else ''} {first.first}"
        where += f"-{first.last - 1}" if first.last - first.first > 1 else ""
    else:
        layers = first.last - first.first
        where = f"{first.stage}-{last.stage}: {layers} layer{'s' * (layers > 1)} each"
    low, high = min(s.memory_bytes for s in run), max(s.memory_bytes for s in run)
    memory = fb(low) if fb(low) == fb(high) else f"{fb(low)}-{fb(high)}"
    active = f" ({_count(first.active_params)} active)" if moe else ""
    return f"{where}, {_count(first.params)}{active}, {memory}"


def _count(n: int) -> str:
    """A parameter count to three figures: 1.23B, 456M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _preset(model: str, revision: str) -> str | None:
    """DeepSpeed's AutoEP preset matching the model's model_type (None: AutoEP tries each)."""
    from toolkit.config.rules.expert_parallel import PRESETS
    from toolkit.plan.arch import load_arch

    model_type = load_arch(model, revision).model_type
    return next((name for name, types in PRESETS.items() if model_type in types), None)


def layout_config(result: PlanResult, index: int = 0) -> dict:
    """The DeepSpeed config of the index-th best layout, through generate-config's build_config (ep > 1: with the
    expert_parallel section and the AutoEP preset of the model's model_type)."""
    from toolkit.config.generate import build_config
    from toolkit.config.options import GenerateOptions

    if not result.fitting:
        raise ConfigError("--emit-config: no layout fits, so there is no config to write")
    r, lay = result.request, result.best[index].layout
    options = GenerateOptions(
        world_size=r.gpus_per_node * r.nodes, nodes=r.nodes, gpus_per_node=r.gpus_per_node, pp=lay.pp, tp=lay.tp,
        mbs=lay.mbs, gbs=r.gbs, zero=lay.zero, precision=r.precision, optimizer=OPTIMIZER_TYPES[r.optimizer],
        offload_optimizer="cpu" if lay.offload != "none" else "none",
        offload_param="cpu" if lay.offload == "all" else "none", activation_checkpointing=lay.checkpointing,
        ep=lay.ep, ep_preset=_preset(r.model, r.revision) if lay.ep > 1 else None)
    cfg = build_config(options)
    if result.best[index].flops_parts:  # the split that fits, which training would not find by FLOPs alone
        cfg["pipeline"]["parts"] = list(result.best[index].parts)
    return cfg
