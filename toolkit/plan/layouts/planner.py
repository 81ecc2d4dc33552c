"""`dstk plan`: every layout of a model on a cluster, its memory per GPU and step time, the best few.

    result = make_plan(PlanRequest(model="llama-3.2-1b", gpus_per_node=8, gpu="a100-80gb", gbs=256))
    result.best[0].layout        # Layout(pp=1, dp=8, zero=..., mbs=..., gas=..., ...)
    result.closest               # when nothing fits: the layout needing the least memory

Layouts: pp dividing the world, up to the model's block count; tensor parallelism (DeepSpeed AutoTP) with
tp dividing the GPUs of a node (a tp group never spans nodes), for models AutoTP can shard
(toolkit.plan.tp.tp_candidates), alone (pp = 1) or inside pipeline stages (3D: dp x pp x tp);
Ulysses sequence parallelism (sp) at tp = 1, alone or inside pipeline stages, for a causal LM whose heads sp
divides; expert parallelism (AutoEP, ep_candidates) for MoE models at tp = sp = 1 under 1F1B, ep inside dp dividing
it and the experts; dp = world / (pp * sp * tp); ZeRO 0-3 at pp = 1 (with or without tp), 0-1 with pp > 1 (DeepSpeed's PipelineEngine
refuses 2/3); mbs * gas * dp = gbs; offload of the optimizer (ZeRO >= 1) or of everything (ZeRO-3); activation
checkpointing on or off. With tp at pp = 1 AutoTP shards every layer it has a plan for (the head, a tied
embedding); inside pipeline stages only the decoder blocks are sharded, the embedding, final norm and
head stay whole on every tp rank (toolkit.distributed.tensor_parallel). Each stage's
layers come from toolkit.plan.cost.partition's exact split (least slowest stage); where that split's heaviest
stage does not fit the GPU, from the split of least slowest stage among those whose every stage fits under
that layout (estimate_split; the rule and its arithmetic: toolkit.plan.cost.partition). The stage with the
most memory is reported, and every stage's parameters, active parameters per token and memory. Estimates:
toolkit.plan.memory.rank (bytes) and toolkit.plan.layouts.estimate (seconds).
Activations come from toolkit.plan.cost.layers: attention="sdpa" (flash / memory-efficient kernels) stores no
(seq x seq) attention probabilities, "eager" does.

LoRA (`lora` = r): adapters of rank r on every block linear, the base frozen. Frozen weights cost their
weight bytes only; the adapters carry gradients, fp32 masters and optimizer states, partitioned by ZeRO
as in full fine-tuning; activations are unchanged; the backward skips the frozen weights' gradients
(toolkit.plan.cost.layers). DeepSpeed's own estimators count every parameter as trainable.
"""

import math
from dataclasses import dataclass, field, replace

from toolkit.errors import ConfigError
from toolkit.plan.lora import check_lora_rank, param_counts
from toolkit.plan.gpus import Gpu, custom_gpu, format_bytes, get_gpu, with_overrides
from toolkit.plan.layouts.estimate import Estimate, Hardware, Layout, Model, predict

ATTENTION = ("sdpa", "eager", "flash_attention_2")
ROWS = ("padded", "full")
MAX_MBS = 2**16  # micro-batch sizes tried: sequences per GPU per micro-batch; no model fits more


@dataclass(frozen=True)
class PlanRequest:
    model: str  # built-in architecture name, a local HF directory, or a hub id (models.weights.hub)
    gbs: int  # global batch (sequences per optimizer step)
    gpus_per_node: int = 8
    nodes: int = 1
    gpu: str | None = None  # preset name (toolkit.plan.gpus.GPUS)
    gpu_mem: int | None = None  # bytes; overrides the preset's memory
    seq_len: int | None = None  # default: min(2048, the model's max_positions)
    precision: str = "bf16"
    optimizer: str = "adam"
    tflops: float | None = None  # dense peak per GPU; overrides the preset
    intra_bw: float | None = None  # GB/s per GPU within a node
    inter_bw: float | None = None  # GB/s per GPU between nodes
    mfu: float = 0.5  # share of peak FLOPs a step achieves
    reserve: float = 0.1  # share of GPU memory kept free for the caching allocator's fragmentation (the CUDA
    # context and NCCL's buffers are counted as fixed bytes, toolkit.plan.memory.overhead; the loss's peak as activations)
    host_mem: int = 2**40  # bytes of host memory per node, for offloaded states
    attention: str = "sdpa"
    offload: bool = True  # consider offload layouts
    expert_parallel: bool = True  # consider expert parallelism (AutoEP) for an MoE model
    checkpointing: bool = True  # consider activation checkpointing
    top: int = 3
    lora: int | None = None  # LoRA rank r: adapters on every block linear train, the base is frozen
    revision: str = "main"  # of a hub id in `model`
    tiled_loss: str = "auto"  # dstk train --tiled-loss: the causal LM loss in tiles (models.tiled.loss)
    tiled_mlp: str = "auto"  # dstk train --tiled-mlp: the blocks' MLPs through TiledMLP (models.tiled.mlp)
    offload_activations: str = "auto"  # dstk train --offload-activations: checkpoints to the host (models.tiled.offload)
    rows: str = "padded"  # the data's rows: "padded" (some padded or packed: sdpa and eager need a (seq x seq) mask)
    # or "full" (every row one document filling it: at pp 1 HF runs sdpa causal with no mask; eager still builds one)


@dataclass
class PlanResult:
    request: PlanRequest
    gpu: Gpu
    seq_len: int
    considered: int
    fitting: list  # Estimates that fit, fastest first (then least memory)
    closest: Estimate | None  # the least memory of all, when none fits
    reasons: list  # one line per shown layout: why it ranks where it does
    params: int = 0  # the model's unique parameters (with LoRA: base + adapters)
    trainable: int = 0  # of which train: all, or LoRA's adapters
    active: int = 0  # of which one token's forward uses: all, or an MoE model's top-k experts per block
    tp_candidates: tuple = (1,)  # tensor-parallel sizes tried (toolkit.plan.tp.tp_candidates)
    notes: list = field(default_factory=list)  # what the plan assumes that the model's config does not say

    @property
    def best(self) -> list:
        """The fastest of each family (pp, ZeRO, offload, checkpointing; best mbs), top few."""
        seen, out = set(), []
        for e in self.fitting:
            lay = e.layout
            family = (lay.pp, lay.tp, lay.sp, lay.ep, lay.zero, lay.offload, lay.checkpointing, lay.schedule)
            if family not in seen and len(out) < self.request.top:
                seen.add(family)
                out.append(e)
        return out

    def to_dict(self) -> dict:
        r = self.request
        return {"model": r.model, "world_size": r.gpus_per_node * r.nodes, "gpu": self.gpu.name,
                "gpu_memory_bytes": self.gpu.memory, "seq_len": self.seq_len, "gbs": r.gbs,
                "precision": r.precision, "lora_r": r.lora, "params": self.params, "trainable_params": self.trainable,
                "active_params": self.active,
                "tp_candidates": self.tp_candidates, "layouts_considered": self.considered,
                "layouts_fitting": len(self.fitting),
                "best": [dict(e.to_dict(), reason=why) for e, why in zip(self.best, self.reasons)],
                "closest": self.closest.to_dict() if self.closest else None, "notes": list(self.notes)}


def make_plan(req: PlanRequest) -> PlanResult:
    """Estimate every layout, rank those that fit by step time (then memory)."""
    from toolkit.plan.tp import tp_candidates

    gpu, arch, seq, costs = _prepare(req)
    tps, hw = tp_candidates(arch, req.gpus_per_node, req.lora), _hardware(req, gpu)
    # one rank's figures per (tp, inside a pipeline): in 3D only the blocks are sharded
    models = {(tp, pipe): model_of(costs, arch, seq, req, tp, pipe) for tp in tps for pipe in (False, True)}
    unfit = {}  # per layout family, the least mbs at which no split fits: a larger mbs needs more memory
    estimates = [estimate_split(models[lay.tp, lay.pp > 1], costs, parts, lay, hw, req, unfit)
                 for parts, lay in candidate_layouts(req, arch, costs, tps)]
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_time, e.memory))
    closest = None if fitting else min(estimates, key=lambda e: e.excess)
    result = PlanResult(req, gpu, seq, len(estimates), fitting, closest, [], *param_counts(arch, req.lora))
    result.active = result.params - arch.inactive_params()
    result.tp_candidates = tuple(tps)
    if "dstk_positions" in arch.extra:  # a rotary model past its positions (_prepare)
        result.notes.append(f"--seq-len {seq} is past {arch.name}'s {arch.extra['dstk_positions']} positions: planned as a "
                            f"long-context variant of it (config.json's max_position_embeddings, and its rope_scaling, "
                            f"raised to {seq}); dstk train refuses a --seq-len past the model's positions")
    best = result.best
    result.reasons = [_reason(e, best, i) for i, e in enumerate(best)]
    return result


def estimate_layout(req: PlanRequest, layout: Layout, parts: list | None = None) -> Estimate:
    """The estimate of one given layout (benchmarks compare it with a measured run): with the planner's split
    (estimate_split), or with `parts` as given."""
    from toolkit.plan.cost.partition import partition_layers

    from toolkit.plan.tp import autotp_problems

    gpu, arch, seq, costs = _prepare(req)
    problems = autotp_problems(arch, layout.tp)
    if problems:
        raise ConfigError(problems[0])
    model = model_of(costs, arch, seq, req, layout.tp, pipeline=layout.pp > 1)
    if parts is not None:
        return predict(_stage_tp_comm(model, costs, parts), parts, layout, _hardware(req, gpu), req.precision,
                       req.optimizer)
    parts = partition_layers(costs, layout.pp * (2 if layout.schedule == "dualpipev" else 1), "compute")
    return estimate_split(model, costs, parts, layout, _hardware(req, gpu), req)


def estimate_split(model: Model, costs: list, parts: list, lay: Layout, hw: Hardware, req: PlanRequest,
                   unfit: dict | None = None) -> Estimate:
    """The estimate of `lay` with the FLOPs split `parts`; when its heaviest stage does not fit (1F1B, pp > 1),
    with the split of least slowest stage among those whose every stage fits this layout's GPU
    (toolkit.plan.cost.partition.fitting_split: an MoE model's stages differ in parameters at equal FLOPs).
    When no split fits, the FLOPs split's estimate stands: the layout does not fit either way. `unfit` (family
    -> mbs) skips the search where a smaller mbs of the same family found no split: every stage's bytes grow
    with mbs (mbs x the micro-batches in flight, min(pp - s, gas) with gas = gbs / (dp x mbs), grows)."""
    from toolkit.plan.cost.partition import fitting_split
    from toolkit.plan.layouts.estimate import stage_fits

    est = predict(_stage_tp_comm(model, costs, parts), parts, lay, hw, req.precision, req.optimizer)
    family = replace(lay, mbs=0, gas=0)
    if est.fits or lay.pp == 1 or lay.schedule != "1f1b" or lay.mbs >= (unfit or {}).get(family, math.inf):
        return est
    fitted = fitting_split(model.flops, lay.pp, stage_fits(model, lay, hw, req.precision, req.optimizer))
    if fitted is None and unfit is not None:
        unfit[family] = min(lay.mbs, unfit.get(family, math.inf))
    if fitted is None or fitted == parts:
        return est
    moved = predict(_stage_tp_comm(model, costs, fitted), fitted, lay, hw, req.precision, req.optimizer)
    slowest = [max(sum(model.flops[lo:hi]) for lo, hi in zip(p, p[1:])) for p in (fitted, parts)]
    moved.flops_parts, moved.split_cost = list(parts), slowest[0] / slowest[1]
    return moved


def _prepare(req: PlanRequest) -> tuple:
    """(gpu, arch, seq_len, per-layer costs for one sequence) after checking the request."""
    from toolkit.plan.arch import load_arch
    from toolkit.plan.cost.layers import layer_costs

    _check_request(req)
    gpu, arch = _gpu(req), load_arch(req.model, req.revision)
    seq = req.seq_len or min(2048, arch.max_positions)
    if seq > arch.max_positions and not arch.learned_positions:  # rotary: its long-context variant (make_plan's note)
        arch = replace(arch, max_positions=seq, extra={**arch.extra, "dstk_positions": arch.max_positions})
    return gpu, arch, seq, layer_costs(arch, seq, 1, req.precision, attention=req.attention, lora=req.lora)


def _hardware(req: PlanRequest, gpu: Gpu) -> Hardware:
    return Hardware(int(gpu.memory * (1 - req.reserve)), req.host_mem // req.gpus_per_node,
                    gpu.tflops(req.precision) * 1e12 * req.mfu, gpu.nvlink, gpu.network, gpu.pcie, req.gpus_per_node)


def _check_request(req: PlanRequest) -> None:
    for flag, value in (("--gbs", req.gbs), ("--gpus-per-node", req.gpus_per_node), ("--nodes", req.nodes),
                        ("--seq-len", req.seq_len), ("--top", req.top)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    for flag, value in (("--tflops", req.tflops), ("--intra-bw", req.intra_bw), ("--inter-bw", req.inter_bw),
                        ("--gpu-mem", req.gpu_mem), ("--host-mem", req.host_mem), ("--mfu", req.mfu),
                        ("--reserve", req.reserve)):
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
    for flag, value in (("--tflops", req.tflops), ("--intra-bw", req.intra_bw), ("--inter-bw", req.inter_bw),
                        ("--gpu-mem", req.gpu_mem), ("--host-mem", req.host_mem)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value!r}")
    if not 0 < req.mfu <= 1:
        raise ConfigError(f"--mfu is the share of peak FLOPs reached, in (0, 1]; got {req.mfu}")
    if not 0 <= req.reserve < 1:
        raise ConfigError(f"--reserve is the share of memory kept free, in [0, 1); got {req.reserve}")
    if req.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--precision {req.precision!r}: use fp32, bf16 or fp16")
    if req.attention not in ATTENTION:
        raise ConfigError(f"--attention {req.attention!r}: use one of {', '.join(ATTENTION)}")
    if req.rows not in ROWS:
        raise ConfigError(f"--rows {req.rows!r}: use one of {', '.join(ROWS)}")
    if req.lora is not None:
        check_lora_rank(req.lora)
    if req.gpu is None and req.gpu_mem is None:
        raise ConfigError("give --gpu NAME (a preset, e.g. a100-80gb, h100-sxm) or --gpu-mem SIZE (e.g. 80GiB)")


def _gpu(req: PlanRequest) -> Gpu:
    """The preset, or a card described by --gpu-mem (A100-like throughput unless --tflops)."""
    if req.gpu is not None:
        base = get_gpu(req.gpu)
    else:
        a100 = get_gpu("a100-80gb")
        base = custom_gpu(req.gpu_mem, req.tflops or a100.bf16_tflops, a100.nvlink, a100.network)
    return with_overrides(base, req.gpu_mem, req.tflops, req.intra_bw, req.inter_bw)


def model_of(costs, arch, seq: int, req: PlanRequest, tp: int = 1, pipeline: bool = False) -> Model:
    """Per-layer figures of one rank: the whole layer, or with tp > 1 one AutoTP shard of it. pipeline:
    the layout has pp > 1, where tp shards only the decoder blocks (the embedding, final norm and head
    stay whole on every tp rank; toolkit.plan.tp.shard_layers)."""
    from toolkit.plan.cost.layers import boundary_bytes, mask_bytes
    from toolkit.plan.tp import shard_layers, tp_comm_bytes

    # the attention mask, whole on every tp rank: one per pipeline stage, shared by its blocks; at pp = 1 one
    # for the model (HF's, per layer kind, made additive once: models.attention.share_additive_masks), none there
    # for rows that are each one whole document under sdpa (HF's causal path: transformers' sdpa_mask skips it)
    causal = req.rows == "full" and req.attention == "sdpa" and not pipeline
    stage_act = 0 if causal else mask_bytes(seq, 1, req.precision, req.attention)
    # p2p model kept as at tp = 1, also with tp inside stages: the whole (1, seq, h) hidden state is
    # counted per rank on the boundary link, and no all-gather. DeepSpeed's pipeline engine sends 1/tp of
    # it per tp rank and all-gathers it on the receiving stage inside the node (pipe_partitioned), so
    # this is an upper bound on the link's bytes; `boundary` is also what activation checkpointing keeps
    # per layer, which is whole on every tp rank.
    boundary = boundary_bytes(arch, seq, 1, req.precision)
    if tp > 1:
        per_rank = shard_layers(arch, costs, seq, req.precision, tp, pipeline)
        comm = tp_comm_bytes(arch, seq, 1, req.precision, tp, pipeline=pipeline)
        recompute = tp_comm_bytes(arch, seq, 1, req.precision, tp, checkpointing=True, pipeline=pipeline) - comm
        return Model(per_rank["params"], per_rank["tied"], per_rank["flops"], per_rank["fwd_flops"],
                     _held_logits(per_rank["act"], costs, arch, seq, req, pipeline), boundary, seq, tp_comm=comm,
                     tp_recompute=recompute, stage_act=stage_act, peak=per_rank["peak"],  # dense only: all active
                     head_loss=_head_loss(arch, seq, req, pipeline), offload=(req.offload_activations, arch.layers),
                     backward=[c.backward_bytes / tp for c in costs])  # AutoTP shards the MLP's intermediate
    return Model([c.params for c in costs], [c.tied_params for c in costs], [c.flops for c in costs],
                 [c.fwd_flops for c in costs], _held_logits([c.act_bytes for c in costs], costs, arch, seq, req,
                                                            pipeline), boundary, seq,
                 trainable=[c.trainable for c in costs] if req.lora else None, stage_act=stage_act,
                 peak=[c.peak_bytes for c in costs], inactive=[c.inactive for c in costs] if arch.is_moe else None,
                 # q and the output (h wide), k and v (kv_heads * head_dim: h * kv_heads / heads, as counted here)
                 attn_bytes=boundary * (2 + 2 * arch.kv_heads / arch.heads) * sum(c.kind == "block" for c in costs),
                 head_loss=_head_loss(arch, seq, req, pipeline), tiled_mlp=_tiled_mlp(arch, costs, seq, req),
                 backward=[c.backward_bytes for c in costs], offload=(req.offload_activations, arch.layers),
                 **_expert_figures(arch, costs, seq, req))


def _expert_figures(arch, costs, seq: int, req) -> dict:
    """Model.experts and Model.routed of an MoE model ({} for a dense one): per MoE block its E routed experts'
    parameters (3 h I_e each), and the bytes one sequence's tokens send in AutoEP's all-to-alls forward: seq x k
    rows of h activations out to their experts (dispatch) and back (combine)."""
    from toolkit.plan.memory.precision import PRECISIONS

    if not arch.is_moe:
        return {}
    moe = [c.kind == "block" and arch.moe_block(i - 1) for i, c in enumerate(costs)]  # costs[0]: the embedding
    experts = arch.experts * 3 * arch.hidden * arch.expert_intermediate
    routed = 2 * seq * arch.experts_per_token * arch.hidden * PRECISIONS[req.precision].act
    return dict(experts=[experts * m for m in moe], routed=[routed * m for m in moe])


def _tiled_mlp(arch, costs, seq: int, req) -> tuple:
    """Model.tiled_mlp at tp 1 (dstk train does not tile AutoTP's sharded MLPs: models.tiled.mlp.layout_blocker): the
    dense MLPs' intermediates of one sequence per layer (the costs' are of `mbs` sequences: layer_costs' mbs 1 here)."""
    return req.tiled_mlp, arch.hidden, arch.intermediate, arch.gated_mlp, [c.mlp_bytes for c in costs]


def _head_loss(arch, seq: int, req, pipeline: bool) -> tuple | None:
    """Model.head_loss: a causal LM's (vocab, --tiled-loss, the logits of one sequence its head layer holds: in a
    pipeline only, _held_logits); None for an encoder's classifier."""
    from toolkit.plan.cost.layers import logits_bytes
    from toolkit.plan.memory.precision import PRECISIONS

    if arch.is_encoder:
        return None
    return arch.vocab, req.tiled_loss, logits_bytes(arch, seq, 1, PRECISIONS[req.precision].act) if pipeline else 0


def _held_logits(act: list, costs, arch, seq: int, req, pipeline: bool) -> list:
    """Activation bytes per layer with the head's logits held per micro-batch in flight in a pipeline (the
    engine's output buffer, toolkit.plan.cost.layers), not at pp = 1: dstk reads the loss of HF's output and drops
    the rest, so the logits live only inside the loss's peak."""
    from toolkit.plan.cost.layers import logits_bytes
    from toolkit.plan.memory.precision import PRECISIONS

    if pipeline:
        return act
    logits = logits_bytes(arch, seq, 1, PRECISIONS[req.precision].act)
    return [a - (logits if c.kind == "head" else 0) for a, c in zip(act, costs)]


def _stage_tp_comm(model: Model, costs: list, parts: list) -> Model:
    """With pp > 1 a tp rank runs the all-reduces of its own stage's blocks only, not the model's: its
    tp traffic per micro-batch is that of the stage with the most blocks (every block sends the same
    bytes; in a pipeline the embedding and head send none, toolkit.plan.tp.tp_comm_bytes)."""
    if len(parts) <= 2 or not model.tp_comm:
        return model
    blocks = [c.kind == "block" for c in costs]
    share = max(sum(blocks[lo:hi]) for lo, hi in zip(parts, parts[1:])) / sum(blocks)
    return replace(model, tp_comm=model.tp_comm * share, tp_recompute=model.tp_recompute * share)


def candidate_layouts(req: PlanRequest, arch, costs: list, tps=(1,)):
    """(parts, Layout) for every feasible layout; ConfigError when the global batch allows none.
    Searches are bounded by the model (pp <= its layers), the node (tp <= its GPUs) and MAX_MBS, never
    by --gbs or the world size. tp > 1 also inside pipeline stages (3D: dstk train shards each stage's
    blocks over its tp group; tp groups are tp consecutive ranks, so inside one node)."""
    world = req.gpus_per_node * req.nodes
    # any pp up to the blocks: the exact split evens uneven counts (DeepSeek-V3's 61 blocks divide by no pp)
    pps = [pp for pp in range(1, min(world, arch.layers) + 1) if world % pp == 0]
    combos = [(pp, tp, 1) for pp in pps for tp in tps if world % (pp * tp) == 0]
    sps = sp_candidates(arch, req.seq_len or min(2048, arch.max_positions), world)
    # sp inside stages too, where the pipeline's embedding adds no learned positions (dstk train's rule)
    combos += [(pp, 1, sp) for pp in pps for sp in sps
               if world % (pp * sp) == 0 and (pp == 1 or not arch.learned_positions)]
    usable = [(pp, tp, sp) for pp, tp, sp in combos if req.gbs % (world // (pp * tp * sp)) == 0]
    if not usable:
        dps = ", ".join(f"dp={world // pp} (pp={pp})" for pp in pps)
        raise ConfigError(f"--gbs {req.gbs}: no layout can form it; gbs must be a multiple of dp, and with "
                          f"world {world} and {arch.layers} blocks the choices are {dps}: use --gbs "
                          f"{_round_up(req.gbs, world // pps[-1])} or a multiple of {world // pps[-1]}")
    for pp, tp, sp in usable:
        dp = world // (pp * tp * sp)
        for schedule, parts in _schedules(costs, pp, tp, sp):
            # flash under sp finds packed documents from position ids at batch size 1 only (dstk train refuses more)
            for mbs in _divisors_up_to(req.gbs // dp, 1 if sp > 1 and req.attention.startswith("flash") else MAX_MBS):
                gas = req.gbs // (dp * mbs)
                if schedule == "dualpipev" and gas < 2 * pp:  # DualPipeVSchedule's floor
                    continue
                for zero in (range(2) if pp > 1 else range(4)):
                    for ep in ep_candidates(arch, req, dp, zero, tp, sp, schedule):
                        for offload in _offloads(zero, req.offload):
                            for ckpt in ((False, True) if req.checkpointing else (False,)):
                                yield parts, Layout(pp, dp, zero, mbs, gas, offload, ckpt, tp, sp, schedule, ep)


def _schedules(costs: list, pp: int, tp: int, sp: int) -> list:
    """(schedule, parts): 1F1B on pp stages; with pp > 1 (tp = sp = 1, 2 pp layers at least) also DualPipeV on
    2 pp stages from the same partitioner (dstk train --schedule dualpipev builds those)."""
    from toolkit.plan.cost.partition import partition_layers

    found = [("1f1b", partition_layers(costs, pp, "compute"))]
    if pp > 1 and tp == 1 and sp == 1 and 2 * pp <= len(costs):
        found.append(("dualpipev", partition_layers(costs, 2 * pp, "compute")))
    return found


def sp_candidates(arch, seq: int, world: int) -> list:
    """Ulysses sizes > 1 to try at tp = 1 (any pp): those dividing the world, the sequence and the heads as
    UlyssesSPAttentionHF needs (toolkit.config.rules.sequence_parallel.ulysses_problems); causal LMs only, and
    not MLA (DeepSeek), whose all-to-alls (queries and keys wider than values, model_of's attn_bytes) are not
    modelled."""
    from toolkit.config.rules.sequence_parallel import ulysses_problems

    if arch.model_type == "bert" or arch.is_mla:
        return []
    return [sp for sp in range(2, min(world, arch.heads) + 1)  # sp divides the heads: bounded by them, not the world
            if world % sp == 0 and not ulysses_problems(arch.heads, arch.kv_heads, sp, seq)]


def ep_candidates(arch, req: PlanRequest, dp: int, zero: int, tp: int, sp: int, schedule: str) -> list:
    """Expert-parallel sizes to try: 1, and for an MoE model the divisors of dp (AutoEP groups ep consecutive ranks
    of a stage's dp x sp x tp; dstk train runs it at tp = sp = 1 only) that divide its experts. Not where dstk
    train refuses ep (tp, sp, DualPipeV, LoRA: toolkit.config.rules.expert_parallel.train_refusals), nor at ZeRO-0,
    whose clipping norm is wrong with ep (`dstk validate` refuses it with generate-config's clipping)."""
    if not (arch.is_moe and req.expert_parallel) or tp > 1 or sp > 1 or schedule != "1f1b" or req.lora or zero == 0:
        return [1]
    return [1] + [ep for ep in range(2, dp + 1) if dp % ep == 0 and arch.experts % ep == 0]


def _divisors_up_to(n: int, limit: int) -> list:
    """Divisors of n that are <= limit, in O(limit) (n may be astronomically large)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _offloads(zero: int, allowed: bool) -> tuple:
    if not allowed or zero == 0:
        return ("none",)
    return ("none", "optimizer", "all") if zero == 3 else ("none", "optimizer")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _reason(e: Estimate, ranked: list, index: int) -> str:
    """Why this layout sits where it does: the best against the runner-up, the others against the best."""
    spare = f"{format_bytes(e.capacity - e.memory)} to spare"
    if index == 0:
        if len(ranked) == 1:
            return f"fastest that fits ({e.step_time:.3g} s/step); {spare}"
        return f"fastest: {e.step_time:.3g} s/step; {_compare(ranked[1], e, 'the runner-up')}; {spare}"
    return f"{_compare(e, ranked[0], 'it')}; {spare}"


_PARTS = {"compute": "compute", "bubble": "pipeline bubble", "dp_comm": "data-parallel communication",
          "pp_comm": "pipeline send/receive", "offload": "offload traffic and CPU optimizer",
          "tp_comm": "tensor-parallel all-reduces", "sp_comm": "sequence-parallel all-to-alls",
          "ep_comm": "expert-parallel all-to-alls"}


def _compare(slower: Estimate, faster: Estimate, name: str) -> str:
    """'<name> is 12% slower: +0.3 s of pipeline bubble', or the memory when the times tie."""
    ratio = slower.step_time / faster.step_time - 1
    if ratio < 0.005:
        more = slower.memory - faster.memory
        return f"{name} is as fast but needs {format_bytes(abs(more))} {'more' if more >= 0 else 'less'} memory per GPU"
    part = max(_PARTS, key=lambda k: slower.times[k] - faster.times[k])
    return f"{name} is {ratio:.0%} slower: +{slower.times[part] - faster.times[part]:.3g} s of {_PARTS[part]}"
