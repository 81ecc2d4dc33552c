"""Memory and step time of one layout (pp x dp x tp x ZeRO x mbs/gas x offload x checkpointing) of one model.

All figures are per GPU, per optimizer step, for the pipeline stage whose memory is largest.

Step time = pipeline compute + data-parallel communication + offload traffic, none overlapped
(DeepSpeed's pipeline engine reduces gradients after the last micro-batch; a pessimistic choice
for pp = 1 where ZeRO-2/3 can overlap):
  pipeline    (gas + pp - 1) * t_slowest, t_slowest = slowest stage's FLOPs per micro-batch /
              (peak TFLOPs * mfu) + its activation send/receive; with activation checkpointing
              the forward runs twice. gas + pp - 1 slots of which pp - 1 are the bubble.
  dp comm     ring algorithms, bytes each rank sends for its stage's gradients G = trainable params * w
              and parameters P = params * w: ZeRO-0/1 one all-reduce per step 2(dp-1)/dp * G (ZeRO-1:
              reduce-scatter + all-gather of the updated parameters); ZeRO-2 a reduce-scatter per
              micro-batch (DeepSpeed reduces at every backward) + one all-gather of the updated parameters;
              ZeRO-3 per micro-batch 2 all-gathers of P (forward, backward) + 1 reduce-scatter of G;
              each collective (dp-1)/dp of its bytes.
  pp comm     per micro-batch and stage boundary: activations forward + gradients back, 2 x (mbs, seq, h).
  offload     gradients down and parameters up over PCIe per step, plus CPU Adam at CPU_ADAM params/s;
              ZeRO-3 parameter offload also fetches parameters every micro-batch, forward and backward.
  sp comm     Ulysses (sp > 1, tp = 1; inside pipeline stages too): each rank holds seq / sp tokens, so its
              activations, compute and stage sends are / sp, and it builds no attention mask (dstk's core
              attention runs each document causally, no (seq x seq) mask); per attention layer 4 all-to-alls
              forward (q, k, v, output) and 4 backward, each sending (sp - 1) / sp of the rank's tensor
              (sp_comm_bytes); ZeRO partitions over dp * sp.
  tp comm     AutoTP (tp > 1; in a pipeline only the blocks are sharded): the Model is one tp rank's
              (toolkit.plan.tp.shard_layers: its params, FLOPs and activations), and Model.tp_comm bytes per micro-batch go over `nvlink`
              (a tp group is tp consecutive ranks of one node): two all-reduces of (mbs, seq, h) per block
              forward and two backward (toolkit.plan.tp.tp_comm_bytes). The dp comm above then carries
              the rank's params / tp.
  ep comm     AutoEP (ep > 1, inside dp; tp = sp = 1, 1F1B): a rank holds E / ep of each MoE block's routed experts
              (their weights, gradients and states: toolkit.plan.memory.rank.expert_states); per MoE block and
              micro-batch it sends its tokens x k rows of h out and back by all-to-all (ep_comm_bytes), over
              `nvlink` where its ep consecutive ranks share a node; the experts' gradients are reduced over the
              dp / ep ranks holding the same experts, the dense ones over dp (ep_dp_volume). Compute unchanged:
              the same FLOPs per token (larger per-expert matmuls may run faster; not modelled, not measured).
LoRA (a frozen base, Model.trainable = the adapters per layer): the stage's model states hold gradients and
optimizer states for the adapters only (toolkit.plan.memory.rank), G and the optimizer's traffic shrink to the
adapters', and compute is cost/layers.py's: a frozen matmul's backward computes the input gradient only, about 1 x
its forward instead of 2 x (a simple FLOP count; kernels' efficiency is not modelled).
Links: a data-parallel group (or a stage boundary) inside one node uses `nvlink`, else `network`.

Memory per GPU = model states (toolkit.plan.memory.rank) + activations of the micro-batches in flight, the stage's
attention masks and once the largest backward transient of its layers (the loss's peak on the stage holding the
head, a dense block's MLP gradients: toolkit.plan.cost.layers) +
ZeRO-3's gathered layers + the fixed bytes outside torch's allocator (CUDA context, NCCL buffers:
toolkit.plan.memory.overhead). A layout fits when that is at most the GPU's memory less `--reserve` (the caching
allocator's fragmentation, toolkit.plan.layouts.planner).
"""

from dataclasses import asdict, dataclass, field

from toolkit.plan.memory.rank import (activation_bytes, expert_states, in_flight, in_flight_dualpipev,
                                      model_state_bytes)
from toolkit.plan.memory.overhead import Fixed, fixed_bytes
from toolkit.plan.memory.precision import weight_bytes
from toolkit.plan.layouts.long_sequences import (features, offloaded_checkpoints, tiled_loss_peak, tiled_mlp_flops,
                                                 tiled_mlp_peak)
from toolkit.plan.schedule import bubble_fraction

CPU_ADAM = 1e9  # parameters per second DeepSpeedCPUAdam updates (order of magnitude, many cores)
HALF_TOKENS = 512  # a micro-batch of n tokens reaches n / (n + HALF_TOKENS) of the mfu (small matmuls
# underuse the GPU; a heuristic that makes larger micro-batches faster, not a measurement)


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    zero: int
    mbs: int
    gas: int  # = micro-batches per step under a pipeline
    offload: str = "none"  # none | optimizer | all
    checkpointing: bool = False
    tp: int = 1  # tensor-parallel size (AutoTP); world = pp * dp * sp * tp
    sp: int = 1  # Ulysses sequence-parallel size (pp = tp = 1): each rank holds seq / sp tokens
    schedule: str = "1f1b"  # or "dualpipev" (pp > 1): 2 pp stages, rank r holds stages r and 2 pp - 1 - r
    ep: int = 1  # expert-parallel size (AutoEP, inside dp: ep consecutive ranks of a stage share a block's experts)

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions over and gradients are reduced across: dp * sp (DeepSpeed's
        sequence-data-parallel group: every rank of an sp group holds the whole model)."""
        return self.dp * self.sp

    def describe(self) -> str:
        extra = ([f"offload {self.offload}"] if self.offload != "none" else []) + \
                (["act-ckpt"] if self.checkpointing else [])
        tp = f" tp={self.tp}" if self.tp > 1 else ""
        tp += f" sp={self.sp}" if self.sp > 1 else ""
        tp += f" ep={self.ep}" if self.ep > 1 else ""
        tp += " dualpipev" if self.schedule == "dualpipev" else ""
        return " ".join([f"pp={self.pp} dp={self.dp}{tp} zero={self.zero} mbs={self.mbs} gas={self.gas}"] + extra)


@dataclass(frozen=True)
class StageFigures:
    """One pipeline stage of a layout (one tp rank's share with tp > 1)."""

    stage: int
    first: int  # layers first:last of the pipeline layer list (embed, blocks, norm, head)
    last: int
    params: int  # parameters it holds (a tied head's copy counted; LoRA's adapters too)
    active_params: int  # of which one token's forward uses: all, but an MoE block's k of E routed experts
    flops: float  # forward + backward FLOPs per sequence (one micro-batch of mbs sequences: x mbs)
    memory_bytes: int  # GPU bytes of the rank holding it (DualPipeV: its two stages), fixed bytes included


@dataclass
class Estimate:
    layout: Layout
    stage: int  # the stage whose memory is largest (reported)
    parts: list  # partition boundaries (len pp+1)
    states: object  # memory.ModelStates of that stage
    activations: int  # bytes on that stage
    working: int  # ZeRO-3: full parameters gathered for the running layer and the prefetched next one
    capacity: int  # usable bytes per GPU
    host_capacity: int  # host bytes per GPU for offloaded states
    bubble: float
    dp_comm_bytes: int  # per rank per step
    pp_comm_bytes: int  # per stage boundary per step, both directions
    times: dict = field(default_factory=dict)  # seconds: compute, bubble, dp_comm, pp_comm, offload, tp_comm
    tp_comm_bytes: int = 0  # per rank per step, over its tp group
    sp_comm_bytes: int = 0  # per rank per step, Ulysses' all-to-alls over its sp group
    ep_comm_bytes: int = 0  # per rank per step, AutoEP's dispatch and combine all-to-alls over its ep group
    loss_peak: int = 0  # of `activations`: the loss's transient peak, on the stage holding the head
    mask: int = 0  # of `activations`: the attention masks kept (padded or packed rows at sp 1, sdpa or eager)
    fixed: Fixed = Fixed(0, 0, 0)  # outside torch's allocator: CUDA context, NCCL buffers (toolkit.plan.memory.overhead)
    stages: list = field(default_factory=list)  # StageFigures of every pipeline stage
    flops_parts: list | None = None  # the FLOPs-balanced split `parts` replaced to fit memory (None: it is that one)
    split_cost: float = 1.0  # the slowest stage's FLOPs over the FLOPs split's slowest (>= 1)
    host_activations: int = 0  # checkpointed activations in host memory (--offload-activations), not in `activations`
    features: tuple = ()  # dstk train's long-sequence features on for this layout (long_sequences.features)

    @property
    def allocated(self) -> int:
        """Bytes torch's caching allocator hands out at the peak (what torch.cuda.max_memory_allocated reads)."""
        return self.states.peak + self.activations + self.working

    @property
    def memory(self) -> int:
        return self.allocated + self.fixed.total

    @property
    def fits(self) -> bool:
        return self.memory <= self.capacity and self.states.cpu + self.host_activations <= self.host_capacity

    @property
    def excess(self) -> int:
        """Bytes over the GPU's (or the host's, for offload) capacity; <= 0 when it fits."""
        return max(self.memory - self.capacity, self.states.cpu + self.host_activations - self.host_capacity)

    @property
    def step_time(self) -> float:
        return sum(self.times.values())

    def to_dict(self) -> dict:
        return {"layout": vars(self.layout), "describe": self.layout.describe(), "fits": self.fits,
                "memory_bytes": self.memory, "capacity_bytes": self.capacity, "heaviest_stage": self.stage,
                "model_states": self.states.to_dict(), "activation_bytes": self.activations,
                "zero3_working_bytes": self.working, "host_bytes": self.states.cpu,
                "host_activation_bytes": self.host_activations, "long_sequence_features": list(self.features),
                "loss_peak_bytes": self.loss_peak, "mask_bytes": self.mask, "allocated_bytes": self.allocated,
                "fixed_bytes": {"cuda_context": self.fixed.cuda_context, "nccl": self.fixed.nccl,
                                "nccl_communicators": self.fixed.communicators},
                "bubble": self.bubble, "dp_comm_bytes": self.dp_comm_bytes, "pp_comm_bytes": self.pp_comm_bytes,
                "tp": self.layout.tp, "tp_comm_bytes": self.tp_comm_bytes,
                "sp": self.layout.sp, "sp_comm_bytes": self.sp_comm_bytes,
                "ep": self.layout.ep, "ep_comm_bytes": self.ep_comm_bytes,
                "step_time_s": self.step_time, "times_s": dict(self.times), "parts": list(self.parts),
                "stages": [asdict(s) for s in self.stages], "flops_parts": self.flops_parts,
                "split_cost": self.split_cost}


@dataclass(frozen=True)
class Model:
    """Per-layer figures for one sequence (mbs = 1); everything else scales linearly with mbs."""

    params: list  # parameters per layer (a tied head counts its copy)
    tied: list  # of which copies of the embedding
    flops: list  # forward + backward FLOPs
    fwd_flops: list
    act: list  # activation bytes held per micro-batch of one sequence
    boundary: int  # bytes of one (1, seq, h) hidden state sent between stages
    tokens: int  # seq_len
    trainable: list | None = None  # parameters per layer with gradients and optimizer states (LoRA's
    # adapters); None: every parameter trains
    tp_comm: float = 0.0  # bytes a tp rank sends per micro-batch of one sequence (0 without tp)
    tp_recompute: float = 0.0  # of which again with activation checkpointing (the recomputed forward)
    stage_act: int = 0  # bytes each stage holds once per micro-batch in flight (its attention mask)
    peak: list | None = None  # per layer, transient bytes on top, once per stage (the head's loss)
    attn_bytes: float = 0.0  # q, k, v and the attention output of one sequence, summed over the attention
    # layers: what Ulysses' 4 all-to-alls per layer carry (toolkit.plan.layouts.planner.model_of)
    inactive: list | None = None  # per layer, of `params` those one token's forward leaves unused (an MoE
    # block's E - k experts); None: every parameter runs (active = params)
    head_loss: tuple | None = None  # (vocab, --tiled-loss mode, logits bytes of one sequence the head layer holds):
    # a causal LM's loss, which dstk train tiles where models.tiled.loss.choose says (tiled_loss_peak)
    backward: list | None = None  # per layer, a dense block's backward transient of one sequence (its MLP's
    # gradients: toolkit.plan.cost.layers.mlp_backward_bytes); None: none counted
    tiled_mlp: tuple | None = None  # (--tiled-mlp mode, hidden, intermediate, gated, per layer its dense MLP's
    # intermediates of one sequence, bytes): dstk train runs them through TiledMLP where models.tiled.mlp.choose says
    offload: tuple | None = None  # (--offload-activations mode, the model's decoder blocks): dstk train moves the
    # checkpointed inputs to host memory where models.tiled.offload.choose says (long_sequences.offloaded_checkpoints)
    experts: list | None = None  # per layer, of `params` the routed experts' (all E of an MoE block; AutoEP's
    # ep > 1 leaves E / ep of them on a rank); None: a dense model
    routed: list | None = None  # per layer, bytes one sequence's tokens carry in AutoEP's all-to-alls forward at
    # ep > 1, before the share that stays on the rank: dispatch and combine (toolkit.plan.layouts.planner.model_of)


@dataclass(frozen=True)
class Hardware:
    capacity: int  # usable bytes per GPU
    host_capacity: int  # host bytes per GPU (a node's memory / GPUs per node)
    flops: float  # achieved FLOP/s per GPU (peak * mfu)
    nvlink: float  # bytes/s
    network: float
    pcie: float
    gpus_per_node: int


def stage_params(model: Model, parts: list, s: int) -> int:
    """Parameters stage s stores; a tied head shares the embedding's tensor when both are on s."""
    lo, hi = parts[s], parts[s + 1]
    total = sum(model.params[lo:hi])
    if lo == 0 and hi == len(model.params):
        total -= model.tied[-1]
    return total


def rank_params(model: Model, parts: list, stages: list) -> int:
    """Parameters a pipeline rank stores for its `stages`; DualPipeV's rank 0 holds the embedding and the tied
    head as one module (runtime/pipe/dualpipev.py), so the head's copy is not counted twice."""
    total = sum(stage_params(model, parts, s) for s in stages)
    if len(stages) > 1 and parts[stages[0]] == 0 and parts[stages[1] + 1] == len(model.params):
        total -= model.tied[-1]
    return total


def rank_experts(model: Model, parts: list, stages: list) -> int:
    """Routed-expert parameters of a rank's `stages`, every expert counted (0 for a dense model)."""
    if not model.experts:
        return 0
    return sum(sum(model.experts[parts[s]:parts[s + 1]]) for s in stages)


def rank_held(model: Model, parts: list, stages: list, ep: int) -> int:
    """Parameters a rank stores: with ep > 1 only E / ep of each MoE block's routed experts."""
    return rank_params(model, parts, stages) - rank_experts(model, parts, stages) * (ep - 1) // ep


def rank_trainable(model: Model, parts: list, stages: list) -> int:
    """Parameters of a rank's `stages` that train: all it stores, or with LoRA its adapters."""
    if model.trainable is None:
        return rank_params(model, parts, stages)
    return sum(stage_trainable(model, parts, s) for s in stages)


def stage_trainable(model: Model, parts: list, s: int) -> int:
    """Parameters of stage s that train: all it stores, or with LoRA its adapters (never tied copies)."""
    if model.trainable is None:
        return stage_params(model, parts, s)
    return sum(model.trainable[parts[s]:parts[s + 1]])


def rank_stages(lay: Layout) -> list:
    """The stages each pipeline rank holds: [s] under 1F1B, [r, 2 pp - 1 - r] under DualPipeV."""
    if lay.schedule == "dualpipev":
        return [[r, 2 * lay.pp - 1 - r] for r in range(lay.pp)]
    return [[s] for s in range(lay.pp)]


def dualpipev_bubble(pp: int, micro_batches: int) -> float:
    """Idle share of DeepSpeed 0.19.8's DualPipeVSchedule with a backward taking 2 forwards (weight gradients
    inside it): every rank idles 4 pp - 5 stage-forwards of 6 m + 4 pp - 5 (toolkit.plan.dualpipev times the
    instruction stream; tests/unit/test_plan_dualpipev.py checks the two agree)."""
    return (4 * pp - 5) / (6 * micro_batches + 4 * pp - 5)


def stage_flights(lay: Layout, stages: int) -> list:
    """Micro-batches each of the `stages` stages keeps in flight: 1F1B's, or DualPipeV's."""
    if lay.schedule == "dualpipev":
        return [in_flight_dualpipev(lay.pp, s) for s in range(stages)]
    return [in_flight(lay.pp, lay.gas, s) for s in range(stages)]


def stage_activations(model: Model, lay: Layout, lo: int, hi: int, flight: int) -> tuple[int, int, int]:
    """(bytes, of which the loss's peak, bytes in host memory) of the activations a stage holding layers lo:hi keeps
    with `flight` micro-batches in flight: theirs (or with checkpointing their inputs, on the host under
    --offload-activations but two), the stage's attention mask per micro-batch, and once the largest transient of one
    layer's backward (one runs at a time): the loss's peak on the head, a dense block's MLP gradients (or its TiledMLP
    shard); with checkpointing on top of the one layer recomputed."""
    # sp: a rank holds seq / sp tokens of every activation, and no attention mask (module doc)
    scale = lay.mbs / lay.sp
    per_layer = [a * scale for a in model.act[lo:hi]]
    transient = [t * scale for t in (model.backward or [0] * len(model.act))[lo:hi]]
    tiled = tiled_loss_peak(model, lay) if lo <= len(model.act) - 1 < hi else None
    if tiled is not None:  # the head layer passes the hidden states on: no logits held
        per_layer[-1] -= model.head_loss[2] * scale
    loss = max((model.peak or [0] * len(model.act))[lo:hi]) * lay.mbs // lay.sp if tiled is None else tiled
    if lo <= len(model.act) - 1 < hi:
        transient[-1] = max(transient[-1], loss)
    mlp_peak = tiled_mlp_peak(model, lay, lo, hi)
    if mlp_peak:  # TiledMLP: no block holds its MLP's intermediates; its backward peaks at one shard's
        mlps = model.tiled_mlp[4][lo:hi]
        per_layer = [a - m * scale for a, m in zip(per_layer, mlps)]
        transient = [mlp_peak if m else t for t, m in zip(transient, mlps)]
    host = 0
    if lay.checkpointing:  # each layer's input per micro-batch in flight; the layer recomputed with its transient
        kept, host = offloaded_checkpoints(model, lay, len(per_layer), flight)
        acts = kept + max((a + t for a, t in zip(per_layer, transient)), default=0)
    else:
        acts = activation_bytes(per_layer, [0, hi - lo], 1, lay.gas, None, [flight])[0] + max(transient, default=0)
    acts += stage_mask(model, lay, flight)
    return int(acts), loss, int(host)


def stage_mask(model: Model, lay: Layout, flight: int) -> int:
    """Bytes of the attention masks a stage keeps: one per micro-batch in flight; none under sp (module doc)."""
    return (model.stage_act if lay.sp == 1 else 0) * lay.mbs * flight


def rank_states(model: Model, parts: list, held: list, lay: Layout, precision: str, optimizer: str):
    """memory.ModelStates of the rank holding stages `held` under `parts` (ep > 1: memory.rank.expert_states)."""
    options = dict(precision=precision, optimizer=optimizer, offload=lay.offload, pipeline=lay.pp > 1,
                   overlap_comm=lay.zero == 2,  # generate-config turns it on for ZeRO >= 2
                   fp32_grad_accum=precision == "bf16")  # generate-config's bf16 default
    if lay.ep > 1:  # no LoRA with ep (dstk train refuses it): every parameter trains
        return expert_states(rank_params(model, parts, held), rank_experts(model, parts, held), lay.zero_ranks,
                             lay.ep, lay.zero, **options)
    return model_state_bytes(rank_params(model, parts, held), lay.zero_ranks, lay.zero,
                             trainable=rank_trainable(model, parts, held), **options)


def stage_fits(model: Model, lay: Layout, hw: Hardware, precision: str, optimizer: str):
    """fits(stage, lo, hi): whether a 1F1B stage holding layers lo:hi fits the GPU (and offload the host) under
    this layout: what predict counts for it (toolkit.plan.cost.partition.fitting_split's test)."""
    flights = stage_flights(lay, lay.pp)
    spare = hw.capacity - fixed_bytes(lay.pp, lay.zero_ranks, lay.tp, lay.ep).total
    n = len(model.params)

    def fits(stage, lo, hi):
        parts = [0] * stage + [lo, hi] + [n] * (lay.pp - stage - 1)  # stage s holds lo:hi
        states = rank_states(model, parts, [stage], lay, precision, optimizer)
        acts, _, host = stage_activations(model, lay, lo, hi, flights[stage])
        return states.peak + acts <= spare and states.cpu + host <= hw.host_capacity

    return fits


def predict(model: Model, parts: list, lay: Layout, hw: Hardware, precision: str, optimizer: str) -> Estimate:
    stages = len(parts) - 1
    flights = stage_flights(lay, stages)
    held_acts = [stage_activations(model, lay, parts[s], parts[s + 1], flights[s]) for s in range(stages)]
    acts, peaks, hosts = ([figures[i] for figures in held_acts] for i in range(3))
    totals = []
    for r, held in enumerate(rank_stages(lay)):
        states = rank_states(model, parts, held, lay, precision, optimizer)
        totals.append((states.peak + int(sum(acts[s] for s in held)), r, states))
    _, heaviest, states = max(totals, key=lambda t: t[0])
    held = rank_stages(lay)[heaviest]
    w = weight_bytes(precision)
    # ZeRO-3 gathers a layer's parameters: with ep > 1 its own E / ep experts
    held_layers = [p - e * (lay.ep - 1) // lay.ep for p, e in zip(model.params, model.experts or [0] * len(model.params))]
    working = 2 * max(held_layers) * w if lay.zero == 3 else 0
    bubble = dualpipev_bubble(lay.pp, lay.gas) if lay.schedule == "dualpipev" else bubble_fraction(lay.pp, lay.gas)
    # sp: slices travel; DualPipeV: both phases cross each link
    sends = 2 * model.boundary * lay.mbs * lay.gas * (2 if lay.schedule == "dualpipev" else 1) // lay.sp
    est = Estimate(lay, heaviest, parts, states, int(sum(acts[s] for s in held)), working, hw.capacity,
                   hw.host_capacity, bubble, 0, sends if lay.pp > 1 else 0,
                   loss_peak=max(peaks[s] for s in held), mask=sum(stage_mask(model, lay, flights[s]) for s in held),
                   fixed=fixed_bytes(lay.pp, lay.zero_ranks, lay.tp, lay.ep),
                   host_activations=sum(hosts[s] for s in held), features=features(model, lay, sum(hosts)))
    est.stages = _stage_figures(model, parts, lay, [t[0] + working + est.fixed.total for t in totals])
    _times(est, model, hw, precision)
    return est


def _stage_figures(model: Model, parts: list, lay: Layout, rank_bytes: list) -> list:
    """StageFigures of every stage: its parameters, of which active per token, and its rank's GPU bytes."""
    rank_of = {s: r for r, held in enumerate(rank_stages(lay)) for s in held}
    out = []
    for s in range(len(parts) - 1):
        lo, hi = parts[s], parts[s + 1]
        params = stage_params(model, parts, s)
        inactive = sum(model.inactive[lo:hi]) if model.inactive else 0
        out.append(StageFigures(s, lo, hi, params, params - inactive, sum(model.flops[lo:hi]), rank_bytes[rank_of[s]]))
    return out


def _times(est: Estimate, model: Model, hw: Hardware, precision: str) -> None:
    """Seconds per step by part; a pipeline slot is the slowest stage's micro-batch plus its send/receive."""
    lay, parts = est.layout, est.parts
    w = weight_bytes(precision)
    tokens = lay.mbs * model.tokens // lay.sp  # sp: each rank computes its seq / sp tokens (attention: heads / sp)
    rate = hw.flops * tokens / (tokens + HALF_TOKENS)
    slot = 0.0
    for held in rank_stages(lay):  # a slot: one micro-batch through every stage of the slowest rank
        flops = sum(sum(model.flops[parts[s]:parts[s + 1]]) + (sum(model.fwd_flops[parts[s]:parts[s + 1]])
                                                               if lay.checkpointing else 0)
                    + tiled_mlp_flops(model, lay, parts[s], parts[s + 1]) for s in held)
        slot = max(slot, flops * lay.mbs / lay.sp / rate)
    pp_bw = hw.network if _crosses(lay.dp * lay.sp * lay.tp, lay.pp, hw.gpus_per_node, boundary=True) else hw.nvlink
    send = 2 * model.boundary * lay.mbs / lay.sp / (pp_bw * 1e9) if lay.pp > 1 else 0.0
    heaviest = max(rank_held(model, parts, held, lay.ep) for held in rank_stages(lay))
    trained = max(rank_trainable(model, parts, held) for held in rank_stages(lay))
    est.dp_comm_bytes = int(_dp_volume(lay, trained * w, heaviest * w) if lay.ep == 1 else
                            max(ep_dp_volume(model, parts, held, lay, w) for held in rank_stages(lay)))
    # a dp group spans dp * tp consecutive ranks (its members stride by tp)
    dp_bw = hw.network if _crosses(lay.zero_ranks * lay.tp, lay.pp, hw.gpus_per_node) else hw.nvlink
    est.tp_comm_bytes = int((model.tp_comm + lay.checkpointing * model.tp_recompute) * lay.mbs * lay.gas)
    est.sp_comm_bytes = int(sp_comm_bytes(model.attn_bytes, lay))
    sp_bw = hw.network if lay.sp > hw.gpus_per_node else hw.nvlink  # an sp group: sp consecutive ranks
    est.ep_comm_bytes = int(max(ep_comm_bytes(model, parts, held, lay) for held in rank_stages(lay)))
    # an ep group: ep consecutive ranks of a stage, aligned to multiples of ep
    ep_bw = hw.network if lay.ep > hw.gpus_per_node or hw.gpus_per_node % lay.ep else hw.nvlink
    # DualPipeV: each micro-batch crosses every link twice (out and back); a rank idles (4 pp - 5) / 6 slots
    idle, crossings = ((4 * lay.pp - 5) / 6, 2) if lay.schedule == "dualpipev" else (lay.pp - 1, 1)
    est.times = {"compute": lay.gas * slot, "bubble": idle * (slot + send), "pp_comm": lay.gas * send * crossings,
                 "dp_comm": est.dp_comm_bytes / (dp_bw * 1e9),
                 "offload": _offload_time(lay, trained, heaviest, w, hw),
                 "tp_comm": est.tp_comm_bytes / (hw.nvlink * 1e9), "sp_comm": est.sp_comm_bytes / (sp_bw * 1e9),
                 "ep_comm": est.ep_comm_bytes / (ep_bw * 1e9)}


def sp_comm_bytes(attn_bytes: float, lay: Layout) -> float:
    """Bytes a rank sends per step in Ulysses' all-to-alls: per attention layer 4 of them forward (q, k, v
    in, the output back) and 4 backward (their gradients), 4 more forward with activation checkpointing
    (the recomputed forward), each sending (sp - 1) / sp of the rank's (mbs, seq / sp, width) tensor."""
    if lay.sp == 1:
        return 0.0
    passes = 3 if lay.checkpointing else 2
    return passes * attn_bytes / lay.sp * (lay.sp - 1) / lay.sp * lay.mbs * lay.gas


def ep_comm_bytes(model: Model, parts: list, held: list, lay: Layout) -> float:
    """Bytes a rank sends per step in AutoEP's all-to-alls over its ep group: per MoE block and micro-batch its
    tokens x top-k rows of the hidden size out to their experts and back (dispatch, combine: Model.routed), again
    for the backward (their gradients) and with activation checkpointing for the recomputed forward; of which
    (ep - 1) / ep leaves the rank (routing spread evenly over the experts; a skewed router sends more)."""
    if lay.ep == 1 or not model.routed:
        return 0.0
    passes = 3 if lay.checkpointing else 2
    routed = sum(sum(model.routed[parts[s]:parts[s + 1]]) for s in held)
    return passes * routed * (lay.ep - 1) / lay.ep * lay.mbs * lay.gas


def ep_dp_volume(model: Model, parts: list, held: list, lay: Layout, w: int) -> float:
    """_dp_volume under expert parallelism: the dense parameters over the dp group, the rank's E / ep experts over
    the expert-data-parallel group of dp / ep ranks (DeepSpeed reduces expert gradients there)."""
    experts = rank_experts(model, parts, held)
    dense = (rank_params(model, parts, held) - experts) * w
    local = experts // lay.ep * w
    return _dp_volume(lay, dense, dense) + _dp_volume(lay, local, local, lay.zero_ranks // lay.ep)


def _dp_volume(lay: Layout, grad_bytes: int, param_bytes: int, ranks: int | None = None) -> float:
    """Bytes a rank sends per step: gradients (and updated parameters) of what trains; ZeRO-3 also
    gathers every parameter, frozen ones included, twice per micro-batch. ranks: the group (default dp * sp)."""
    ranks = ranks or lay.zero_ranks
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks  # of the bytes, in one reduce-scatter or all-gather
    if lay.zero <= 1:
        return 2 * share * grad_bytes
    if lay.zero == 2:
        return (lay.gas + 1) * share * grad_bytes
    return lay.gas * share * (2 * param_bytes + grad_bytes)


def _offload_time(lay: Layout, trainable: int, params: int, w: int, hw: Hardware) -> float:
    """Seconds of offload traffic and CPU Adam: the trainable partition's gradients down and updated
    parameters up; offload "all" also fetches every parameter forward and backward per micro-batch."""
    if lay.offload == "none":
        return 0.0
    part = trainable / lay.zero_ranks
    seconds = 2 * part * w / (hw.pcie * 1e9) + part / CPU_ADAM
    if lay.offload == "all":
        seconds += 2 * lay.gas * params / lay.zero_ranks * w / (hw.pcie * 1e9)
    return seconds


def _crosses(span: int, pp: int, gpus_per_node: int, boundary: bool = False) -> bool:
    """Whether some stage's group of `span` consecutive ranks (its dp x tp ranks: ranks s*span ..
    s*span+span-1) spans two nodes, or with boundary=True whether some stage boundary does (rank r and
    r + span). Ranks follow DeepSpeed's (pipe, data, model) order."""
    if not boundary:
        return any((s * span) // gpus_per_node != (s * span + span - 1) // gpus_per_node for s in range(pp))
    return any(r // gpus_per_node != (r + span) // gpus_per_node for r in range((pp - 1) * span))
