"""Bytes a training rank holds: model states (parameters, gradients, fp32 master weights, optimizer
states) under ZeRO 0-3, and activations kept by DeepSpeed's 1F1B pipeline schedule.

    states = model_state_bytes(num_params=1_235_814_400, dp=8, zero=1, precision="bf16")
    states.peak          # bytes on the GPU at the worst moment of a step
    model_state_bytes(num_params=1_247_086_592, dp=8, zero=1, trainable=11_272_192)   # LoRA r=16
    in_flight(pp=4, micro_batches=16, stage=0)   # 4 micro-batches of activations alive on stage 0

The counts follow what DeepSpeed 0.19 allocates (read in runtime/engine.py `_do_optimizer_sanity_check`,
runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py) and, for fp32, what
tests/distributed/test_memory_accuracy.py measures on real engines. A step has two moments:
  backward: parameters, the gradients being accumulated, master weights, optimizer states, and the
            reduction bucket (ZeRO >= 1: `reduce_bucket_size` elements of the gradient dtype); for ZeRO-1
            the boundary backward, where the gradient partition is filled beside the full gradients;
  step:     parameters, the fp32 gradient partition the optimizer reads, master weights, states.
`peak` is the larger one. Master weights: ZeRO >= 1 always keeps its own fp32 copy of the rank's
partition (a clone even when the model is fp32).

A frozen base (LoRA: `trainable` = the adapters): DeepSpeed's ZeRO-1/2 and BF16 optimizers flatten only
parameters with requires_grad, and only those get gradients; so gradients, fp32 masters and optimizer
states exist for the trainable parameters alone, partitioned over dp as above, while frozen weights cost
their weight bytes on every dp rank (ZeRO-3 partitions them too). The reduction bucket keeps its full
`reduce_bucket_size`, however few parameters train. DeepSpeed's own estimators count every parameter as
trainable, so they overstate LoRA several times over (bf16 with Adam: about 16 bytes per frozen parameter
instead of 2).

Expert parallelism (DeepSpeed AutoEP, ep > 1: `expert_states`): a rank holds E / ep of each MoE block's routed
experts, and ZeRO partitions their gradients, masters and optimizer states over the expert-data-parallel group
(dp / ep ranks) while the dense rest is partitioned over dp as above. So a rank holds 1/ep of the experts' weights
(and ZeRO-0/1's full gradients), and at ZeRO >= 1 the same experts / dp of their masters and states as at ep 1.

Activations: bytes per layer per micro-batch (N = mbs*seq tokens) come from toolkit.plan.cost.layers, which
counts the tensors HF's modules save for backward (norm inputs, q/k/v, attention output, MLP
intermediates; (seq x seq) probabilities only under eager attention). It plays the role of Korthikanti
et al. 2022's sbh(34 + 5as/h) bytes per 16-bit Megatron layer, fitted to HF layers instead. Here they
are multiplied by the micro-batches 1F1B keeps in flight on each stage.
"""

from dataclasses import asdict, astuple, dataclass

from toolkit.errors import ConfigError
from toolkit.plan.memory.precision import FP32, optimizer_bytes, weight_bytes

OFFLOADS = ("none", "optimizer", "all")  # all = optimizer and parameters (ZeRO-3 only)
DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size (elements)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank at the peak moment of a step; `cpu` is what offload keeps in host memory."""

    params: int
    grads: int
    master: int  # fp32 master weights (0 for fp32 without ZeRO: the optimizer updates the model)
    optimizer: int
    buffers: int  # gradient reduction bucket
    cpu: int = 0

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.master + self.optimizer + self.buffers

    def to_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def model_state_bytes(num_params: int, dp: int, zero: int, precision: str = "bf16", optimizer: str = "adam",
                      offload: str = "none", pipeline: bool = False,
                      reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET, overlap_comm: bool = False,
                      trainable: int | None = None, fp32_grad_accum: bool = False) -> ModelStates:
    """Model-state bytes of one rank holding `num_params` parameters (its pipeline stage), in a
    data-parallel group of `dp`. `pipeline` selects DeepSpeed's pipeline-engine optimizer choices.
    `overlap_comm` (ZeRO 1/2): DeepSpeed double-buffers the reduction bucket (stage_1_and_2.py
    setup_buckets), so two buckets are held during backward. `trainable`: how many of the `num_params`
    get gradients and optimizer states (None: all); the others are frozen, weights only.
    `fp32_grad_accum` (bf16 with data_types.grad_accum_dtype fp32, generate-config's bf16 default at ZeRO-1):
    DeepSpeed's BF16_Optimizer, which sums every gradient into a full fp32 buffer on each rank
    (bf16_optimizer.py fp32_groups_gradients_flat: 4 bytes per trained parameter, not partitioned) beside the
    bf16 gradients until the step, and keeps fp32 masters and states for the rank's partition (measured on a
    CPU engine, 2.1M parameters at dp 1: 40.0 MiB held after backward, 36.0 after the step; predicted 40.0)."""
    _check_states(num_params, dp, zero, precision, optimizer, offload)
    n = _check_trainable(trainable, num_params)  # the parameters that train; the others are frozen
    w = weight_bytes(precision)
    k = optimizer_bytes(optimizer)
    shard = dp if zero >= 1 else 1
    bf16_optimizer = fp32_grad_accum and w != FP32 and zero == 1
    if bf16_optimizer:  # the bf16 gradients stay attached until the step; no reduction buckets
        master_n, opt_n, grad_bw, grad_step = _ceil(n, dp), _ceil(n, dp), n * (FP32 + w), n * FP32
    elif zero == 0:
        master_n, opt_n, grad_bw, grad_step = _zero0_layout(n, dp, w, pipeline)
    else:
        master_n = opt_n = _ceil(n, shard)
        # ZeRO-1 accumulates full gradients in param.grad until the boundary; ZeRO >= 2 reduces
        # each bucket into the rank's partition during backward.
        grad_bw = (n if zero == 1 else _ceil(n, dp)) * w
        if zero == 1 and offload == "none":
            # At the boundary ZeRO-1 allocates the partition it copies reduced gradients into
            # (grads_in_partition) while the accumulated full gradients are still held; a pipeline
            # engine always reduces after the last micro-batch's backward.
            grad_bw += _ceil(n, dp) * w
        # At the step the optimizer reads an fp32 partition; ZeRO-3 keeps its bit16 partition buffer
        # beside it, ZeRO-1/2 free it (for fp32 it is the same tensor).
        grad_step = _ceil(n, dp) * FP32 + (_ceil(n, dp) * w if zero == 3 or w != FP32 else 0)
    params = (_ceil(num_params, dp) if zero == 3 else num_params) * w  # frozen weights included
    master, opt = master_n * FP32, opt_n * k
    bucket = int(reduce_bucket_size) * w if zero >= 1 and n and not bf16_optimizer else 0
    if overlap_comm and zero in (1, 2):
        bucket *= 2
    # The moments differ only in gradients and buffers: keep the larger one.
    step_bucket = bucket if zero == 3 else 0  # ZeRO-3 keeps its bucket; ZeRO-1/2 free it after backward
    grads, buffers = (grad_bw, bucket) if grad_bw + bucket >= grad_step + step_bucket else (grad_step, step_bucket)
    cpu = 0
    if offload != "none":  # master, states and the fp32 gradient partition live in host memory
        cpu = master + opt + _ceil(n, dp) * FP32
        master, opt, grads = 0, 0, grad_bw  # (ZeRO-1 offload copies reduced gradients to host buffers)
    if offload == "all":
        cpu, params = cpu + params, 0
    return ModelStates(params, grads, master, opt, buffers, cpu)


def expert_states(num_params: int, experts: int, dp: int, ep: int, zero: int, **kwargs) -> ModelStates:
    """Model states of a rank under expert parallelism: of its `num_params`, `experts` are routed-expert parameters
    (every expert of its blocks, as at ep 1) of which it holds experts / ep, partitioned over dp / ep ranks; the rest
    over dp (module docstring). One reduction bucket, the larger of the two; kwargs: model_state_bytes's (no LoRA:
    dstk train refuses it with ep)."""
    if ep == 1 or not experts:
        return model_state_bytes(num_params, dp, zero, **kwargs)
    if dp % ep or experts % ep:
        raise ConfigError(f"ep {ep} must divide dp ({dp}) and the expert parameters ({experts})")
    dense = model_state_bytes(num_params - experts, dp, zero, **kwargs) if num_params > experts else None
    routed = model_state_bytes(experts // ep, dp // ep, zero, **kwargs)
    if dense is None:
        return routed
    fields = [a + b for a, b in zip(astuple(dense), astuple(routed))]
    fields[4] = max(dense.buffers, routed.buffers)  # one bucket at a time
    return ModelStates(*fields)


def _zero0_layout(n: int, dp: int, w: int, pipeline: bool) -> tuple[int, int, int, int]:
    """(master elements, optimizer-state elements, gradient bytes in backward, at the step) without
    ZeRO. fp32: torch's optimizer updates the model directly. bf16 under the pipeline engine:
    BF16_Optimizer (bf16 gradient accumulation, fp32 master and states partitioned over dp).
    Otherwise fp16/bf16: FP16_Optimizer (full fp32 master and states, fp32 gradients at the step)."""
    if w == FP32:
        return 0, n, n * w, n * w
    if pipeline and w == weight_bytes("bf16"):
        return _ceil(n, dp), _ceil(n, dp), n * w, n * w + _ceil(n, dp) * FP32
    return n, n, n * w, n * w + n * FP32


def in_flight(pp: int, micro_batches: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` keeps for backward under 1F1B: DeepSpeed's
    TrainSchedule.num_pipe_buffers() = max(2, min(pp - stage, micro_batches)). Without a pipeline
    (pp == 1) one micro-batch at a time."""
    if pp == 1:
        return 1
    return max(2, min(pp - stage, micro_batches))


def in_flight_dualpipev(pp: int, stage: int) -> int:
    """Micro-batches stage `stage` (of 2 pp) keeps for backward under DeepSpeed's DualPipeVSchedule: 2 pp - stage
    (rank r: 2 pp - r in its phase-0 stage r, r + 1 in its phase-1 stage 2 pp - 1 - r; at most 2 pp + 1 together,
    read from the instruction stream in tests/unit/test_plan_dualpipev.py)."""
    return 2 * pp - stage


def activation_bytes(per_layer: list[int], pp_layers: list[int], pp: int, micro_batches: int,
                     checkpoint_bytes: list[int] | None = None, flights: list[int] | None = None) -> list[int]:
    """Activation bytes per stage: the stage's per-micro-batch activations times `in_flight`.
    `per_layer` holds one micro-batch's bytes per layer; `pp_layers` the stage boundaries (length
    pp+1, as partition `parts`). With activation checkpointing (`checkpoint_bytes` = bytes each layer's
    input takes), a stage keeps only the inputs per micro-batch in flight plus one layer recomputed.
    flights: micro-batches in flight per stage, when not 1F1B's (DualPipeV: in_flight_dualpipev)."""
    flights = flights or [in_flight(pp, micro_batches, s) for s in range(pp)]
    out = []
    for s in range(pp):
        layers = range(pp_layers[s], pp_layers[s + 1])
        if checkpoint_bytes is None:
            out.append(sum(per_layer[i] for i in layers) * flights[s])
        else:
            kept = sum(checkpoint_bytes[i] for i in layers) * flights[s]
            out.append(kept + max((per_layer[i] for i in layers), default=0))
    return out


def _check_trainable(trainable, num_params: int) -> int:
    """The trainable count: `num_params` when None, else an integer in [0, num_params]."""
    if trainable is None:
        return num_params
    if isinstance(trainable, bool) or not isinstance(trainable, int) or not 0 <= trainable <= num_params:
        raise ConfigError(f"trainable must be an integer in [0, num_params({num_params})], got {trainable!r}")
    return trainable


def _check_states(num_params, dp, zero, precision, optimizer, offload) -> None:
    for name, value in (("num_params", num_params), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    weight_bytes(precision), optimizer_bytes(optimizer)  # refuse unknown names
    if offload not in OFFLOADS:
        raise ConfigError(f"offload {offload!r} unknown; use one of {', '.join(OFFLOADS)}")
    if offload != "none" and zero == 0:
        raise ConfigError("offload needs ZeRO >= 1 (DeepSpeed ignores offload_optimizer with stage 0)")
    if offload == "all" and zero != 3:
        raise ConfigError(f"offload 'all' (parameters too) needs ZeRO-3, got ZeRO-{zero}")


def _ceil(n: int, d: int) -> int:
    return -(-n // d)
