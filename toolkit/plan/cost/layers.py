"""Per-layer costs of a transformer's pipeline layer list, from its dimensions alone (no torch).

The layer list is the one models/ builds: [embed, block x L, norm, head] for causal LMs and
[embed, block x L, head] for BERT. `layer_costs(arch, seq_len, mbs)` gives one LayerCost each.

Notation: a micro-batch is B = mbs sequences of T = seq_len tokens, N = B*T tokens; h hidden,
I intermediate, V vocab, a query heads, qd = a*head_dim, kd = kv_heads*head_dim.

FLOPs (a multiply-add counts 2), per micro-batch, forward:
  linear a -> b     2*N*a*b
  block             2*N*h*(qd + 2*kd) + 2*N*qd*h            q, k, v and output projections
                                                            (MLA: 2*N*in*out of each of its projections,
                                                            toolkit.plan.mla)
                    + 2*B*T^2*a*(head_dim + v_head_dim)     QK^T and P@V over the full T x T matrix (4*B*T^2*qd
                                                            when value heads are as wide as query heads)
                                                            (eager / SDPA-math; flash kernels skip
                                                            the masked half of a causal one)
                    + (3 if gated else 2) * 2*N*h*I          MLP
                    + 10*N*h + 5*B*a*T^2 + 4*N*I             two norms, softmax, activation (rough)
  MoE block         the MLP term becomes toolkit.plan.moe's: 2*N*h*E (router) + k * 3 * 2*N*h*I_e
                    (each token's top-k experts, not all E) + 3 * 2*N*h*I_s + 2*N*h (shared expert, gate)
  embed             0                                        a lookup
  norm              5*N*h
  head              2*N*h*V (+ 2*N*h*h BERT's transform)     logits
                    + 5*N*V                                  log-softmax + NLL (rough)
  backward          2 x forward (gradient of the input and of the weights), except the embedding,
                    whose backward is a scatter-add of N*h gradients.
  LoRA (lora=r)     each adapted linear a -> b adds 2*N*r*(a + b) forward, 2 x that backward; a frozen
                    weight's matmul skips its weight gradient (backward 1 x its forward: the input
                    gradient only), and the frozen embedding has no backward at all. Attention's
                    QK^T and P@V and the elementwise terms keep 2 x forward (their inputs need gradients).
Elementwise terms are rough and small next to the matmuls; on CPUs they cost more time than
their FLOPs suggest (memory bound): the `profile` partition method measures instead.

Memory, bytes (see toolkit.plan.memory.precision): model states = params * param bytes + trainable * (grad + optimizer
bytes); trainable = params, or with LoRA the adapters alone (frozen weights are held, nothing else).
An MoE block's params are all E experts (every rank holds them), while its FLOPs count the k a token runs.
LoRA leaves activations as they are: the frozen base still backpropagates through them. Activations
held per micro-batch between its forward and backward (no activation checkpointing), with
e = bytes per activation element:
  embed   8*N (token ids) (+ 2*e*N*h BERT's LayerNorm)
  block   e*N*(2*k*h                                       two norms: LayerNorm in, out (k=2); RMSNorm
                                                           in, fp32 normalised, out (k=3)
               + 2*qd + 2*kd                                q, k, v, attention output
               + (qd + kd if rotary)                        rotary's saved inputs
               + (2*qd + 2*kd with q/k norms)               their inputs and fp32 normalised (Qwen3, OLMoE)
               (MLA: the q, k, v terms become toolkit.plan.mla.mla_act_elements: latents, their norms,
               queries and keys a*(nope + rope) wide, values and output a*v)
               + m*I)                                       MLP: m = 2 (fc and activation outputs; 5 for
                                                           GPT-2's gelu_new, MLP_SAVED) + 2 if gated
          + c*e*B*a*T^2                                    attention="eager": c = 2 (softmax output and the
                                                           copy P@V reads) + 1 with attention dropout;
                                                           attention="sdpa" (flash / efficient): c = 0
                                                           (on CPU, SDPA with dropout falls back to the
                                                           math path and keeps them: use "eager")
          MoE block: the e*N*m*I term becomes toolkit.plan.moe.moe_act_bytes: per routed row (k*N of
          them) its input, 4*I_e intermediates, its output and the scaled copy; the router's fp32
          probabilities (E per token)
  norm    k/2 * e*N*h (LayerNorm: input; RMSNorm: input and normalised)
  head    e*N*h (x5 BERT's transform)                      input, saved by the matmul
          + e*N*V                                          the logits: DeepSpeed's pipeline engine keeps the
                                                           last stage's outputs in its buffer per micro-batch
                                                           in flight (its last-stage backward returns before
                                                           `pipe_buffers['outputs'][id] = None`, pipe/engine.py);
                                                           at pp = 1 dstk drops HF's output, and the planner
                                                           leaves them out (toolkit.plan.layouts.planner)
These follow the tensors HF's modules save for backward (checked in tests/unit/test_costs.py with
saved_tensors_hooks); dropout masks are not counted.
Loss peak (peak_bytes, the head only): 12*N*V on top of what is held, once per stage (the last stage runs
each micro-batch's loss forward and backward back to back). The loss casts the logits to fp32 (4*N*V, freed
after the log-softmax), keeps the fp32 log-softmax (4*N*V) for backward, and its backward holds that, the
log-softmax's gradient and the logits' fp32 gradient at once (3 x 4*N*V), whatever the activations' dtype:
10-12 x N*V bytes with bf16 logits, measured in tests/unit/test_costs.py. Tiled (dstk train --tiled-loss,
models.tiled.loss): 4 fp32 (tile, V) tensors at once in its backward (the tile's logits, their log-softmax, its
gradient, the logits' gradient) + e*N*h, the hidden states' gradient it fills
(toolkit.plan.layouts.long_sequences.tiled_loss_bytes).
Backward transient (backward_bytes, dense blocks): 2*e*N*I on top of what the block holds while its MLP's backward
runs (the gradients of its intermediates; measured: 2.0 x for a gated MLP, 1.75 x for GPT-2's). One layer runs its
backward at a time, so a stage adds the largest of its layers' transients once: the loss's peak when V is large,
the block's for a small vocabulary or a tiled loss; with activation checkpointing on top of the recomputed layer.
Attention mask (mask_bytes), for padded or packed rows: e*B*T^2, the (B, 1, T, T) additive mask in the
activations' dtype that sdpa's memory-efficient kernel and eager keep for backward. A pipeline stage builds
one per micro-batch (models/attention.py) that all its blocks share: once per stage and micro-batch in
flight (toolkit.plan.layouts.estimate). At pp = 1 the HF model builds one per layer kind and micro-batch, which
dstk has built additive (models.attention.share_additive_masks; a bool one torch would convert at every layer):
counted as one. flash_attention_2 takes variable-length offsets instead: 0. Rows that are each one document
filling the row (no padding, no packing: PlanRequest.rows = "full", `dstk plan --rows full`) need none at pp = 1
under sdpa: HF then runs sdpa causal without a mask. The planner cannot see the data, so it counts the mask unless
told: one padded or packed micro-batch in a run builds it (a document longer than --seq-len leaves its cut-off
rest in a row of its own, padded or packed with others).
Under 1F1B, stage s of pp keeps min(pp - s, micro-batches) micro-batches in flight.
TiledMLP (dstk train --tiled-mlp, models.tiled.mlp): a dense block holds none of its MLP's m*I per token, which
DeepSpeed's TiledMLP recomputes in shards in the backward; the stage then peaks once at one shard's m*I per token
and the (N, h) input gradient it fills (toolkit.plan.layouts.long_sequences.tiled_mlp_peak).
"""

from dataclasses import dataclass

from toolkit.errors import ConfigError
from toolkit.plan.arch import Arch, attention_linears, layer_inactive_params, layer_params
from toolkit.plan.mla import mla_act_elements
from toolkit.plan.lora import block_linears, lora_params
from toolkit.plan.moe import moe_act_bytes, moe_elementwise_flops, moe_flops
from toolkit.plan.memory.precision import PRECISIONS, weight_bytes


@dataclass(frozen=True)
class LayerCost:
    """What one entry of the pipeline layer list costs, per micro-batch."""

    name: str  # "embed", "block.0", ..., "norm", "head"
    kind: str  # "embed" | "block" | "norm" | "head" (models' spec.kinds)
    typename: str  # class name that DeepSpeed's partition_method "type:REGEX" matches
    params: int  # parameters the stage holding this layer stores (a tied head counts its copy; LoRA adapters too)
    tied_params: int  # how many of `params` are a copy of another layer's (tied embedding)
    fwd_flops: float  # forward FLOPs per micro-batch
    flops: float  # forward + backward FLOPs per micro-batch
    state_bytes: int  # parameters + gradients + optimizer states of the trainable ones (no ZeRO sharding)
    act_bytes: int  # activations held per micro-batch in flight, until its backward
    trainable: int  # of `params`, those with gradients and optimizer states: all, or LoRA's adapters
    peak_bytes: int = 0  # transient bytes on top, once per stage (the head: its loss; module docstring)
    inactive: int = 0  # of `params`, those one token's forward leaves unused (MoE: the E - k experts it skips)
    mlp_bytes: int = 0  # of act_bytes, a dense block's MLP intermediates (mlp_act_bytes; --tiled-mlp drops them)
    backward_bytes: int = 0  # a dense block's backward transient on top of what it holds (mlp_backward_bytes):
    # once per stage, the larger of it and the loss's peak (one layer runs its backward at a time)

    def memory(self, in_flight: int = 1) -> int:
        """Bytes this layer needs on its stage with `in_flight` micro-batches awaiting backward."""
        return self.state_bytes + in_flight * self.act_bytes + self.peak_bytes


def _block_flops(arch: Arch, b: int, t: int, moe: bool) -> float:
    n, h, i = b * t, arch.hidden, arch.intermediate
    attn = 2 * b * t * t * arch.heads * (arch.head_dim + arch.v_head_dim)  # scores over head_dim, P@V over v
    mlp = moe_elementwise_flops(arch, n) if moe else 4 * n * i
    elementwise = 10 * n * h + 5 * b * arch.heads * t * t + mlp
    return _weight_flops(arch, "block", b, t, moe) + attn + elementwise  # projections and MLP + the rest


def _weight_flops(arch: Arch, kind: str, b: int, t: int, moe: bool = False) -> float:
    """Forward FLOPs of the matmuls against weight matrices (a frozen one skips their weight gradient);
    `moe`: the block routes tokens to experts (the router, k experts per token, the shared expert)."""
    n, h = b * t, arch.hidden
    if kind == "block":
        mlp = moe_flops(arch, n) if moe else (3 if arch.gated_mlp else 2) * 2 * n * h * arch.intermediate
        return 2 * n * sum(i * o for i, o in attention_linears(arch)) + mlp
    if kind == "head":
        return 2 * n * h * arch.vocab + arch.is_encoder * 2 * n * h * h
    return 0.0


def _lora_flops(arch: Arch, kind: str, b: int, t: int, lora: int | None, moe: bool) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs of one layer under LoRA of rank `lora` (module docstring)."""
    fwd = _fwd_flops(arch, kind, b, t, moe)
    if kind == "embed":
        return fwd, fwd  # frozen lookup, integer inputs: nothing to backpropagate
    if kind == "block":
        linears = block_linears(arch, moe)
    elif kind == "head" and arch.is_encoder:
        linears = [(arch.hidden, arch.hidden)]  # BERT's MLM transform, adapted too (toolkit.plan.lora)
    else:
        linears = []
    adapters = sum(2 * b * t * lora * (i + o) for i, o in linears)
    return fwd + adapters, 3 * fwd - _weight_flops(arch, kind, b, t, moe) + 3 * adapters


def _fwd_flops(arch: Arch, kind: str, b: int, t: int, moe: bool = False) -> float:
    """Forward FLOPs of one layer for b sequences of t tokens (formulas in the module docstring)."""
    n, h, v = b * t, arch.hidden, arch.vocab
    if kind == "block":
        return _block_flops(arch, b, t, moe)
    if kind == "norm":
        return 5 * n * h
    if kind == "head":
        return 2 * n * h * v + arch.is_encoder * 2 * n * h * h + 5 * n * v
    return 0.0  # embedding lookup


# N x I tensors an MLP saves for backward: fc output and activation output; HF's gelu_new (GPT-2) is
# built of elementwise ops that save 5; a gated MLP also saves the up output and the product.
MLP_SAVED = {"gelu_new": 5}


def _act_bytes(arch: Arch, kind: str, b: int, t: int, e: int, attention: str, moe: bool = False) -> int:
    """Activation bytes held per micro-batch (formulas in the module docstring); e bytes per element."""
    n, h = b * t, arch.hidden
    k = 2 if arch.norm == "layernorm" else 3
    if kind == "block":
        qd, kd = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        if arch.is_mla:
            per_token = 2 * k * h + mla_act_elements(arch)
        else:
            per_token = (2 * k * h + 2 * qd + 2 * kd + (not arch.learned_positions) * (qd + kd)
                         + bool(arch.qk_norm) * 2 * (qd + kd))
        copies = (2 + arch.attn_dropout) if attention == "eager" else 0
        mlp_bytes = moe_act_bytes(arch, n, e) if moe else mlp_act_bytes(arch, n, e)
        return e * n * per_token + mlp_bytes + copies * e * b * arch.heads * t * t
    if kind == "norm":
        return e * n * h * k // 2
    if kind == "head":
        return e * n * h * (5 if arch.is_encoder else 1) + logits_bytes(arch, t, b, e)
    return 8 * n + arch.is_encoder * 2 * e * n * h  # embed: int64 ids (+ BERT's LayerNorm)


def mlp_act_bytes(arch: Arch, n: int, e: int) -> int:
    """Bytes a dense block's MLP saves for backward for n tokens: m (tokens x I) tensors (module docstring). Under
    dstk train --tiled-mlp (models.tiled.mlp) a block holds none of them, only one shard's while it runs."""
    return e * n * (MLP_SAVED.get(arch.act_fn, 2) + 2 * arch.gated_mlp) * arch.intermediate


def mlp_backward_bytes(arch: Arch, n: int, e: int) -> int:
    """Bytes a dense block's backward allocates on top of what it holds, for n tokens: two (tokens x I) gradients
    at once in its MLP's backward (module docstring; measured in tests/unit/test_costs.py)."""
    return 2 * e * n * arch.intermediate


def logits_bytes(arch: Arch, seq_len: int, mbs: int, e: int) -> int:
    """Bytes of one micro-batch's (mbs, seq_len, V) logits in the activations' dtype (e bytes each)."""
    return e * mbs * seq_len * arch.vocab


def loss_peak_bytes(arch: Arch, seq_len: int, mbs: int = 1) -> int:
    """Bytes the loss allocates beyond what is held, at its peak (module docstring): three fp32 (N, V)
    tensors, the log-softmax, its gradient and the logits' gradient, whatever the activations' dtype."""
    return 3 * 4 * mbs * seq_len * arch.vocab


# Class names of models/' pipeline layers, which DeepSpeed's "type:REGEX" matches (a tied head is a
# TiedLayerSpec of the first layer's class). tests/unit/test_costs_models.py checks they agree.
_TYPENAMES = {"gpt2": ("GPT2Embed", "GPT2BlockStage", "FinalNorm"), "bert": ("BertEnds", "BertLayerStage", None)}


def _typename(arch: Arch, kind: str) -> str:
    embed, block, norm = _TYPENAMES.get(arch.model_type, ("EmbedStage", "DecoderBlock", "FinalNorm"))
    if kind == "head":
        return embed if arch.tied else ("BertClassifierHead" if arch.is_encoder else "LMHead")
    return {"embed": embed, "block": block, "norm": norm}[kind]


ATTENTIONS = ("sdpa", "eager", "flash_attention_2")


def layer_costs(arch: Arch, seq_len: int, mbs: int = 1, precision: str = "bf16",
                attention: str = "sdpa", lora: int | None = None) -> list[LayerCost]:
    """One LayerCost per pipeline layer, for micro-batches of `mbs` sequences of `seq_len` tokens.
    attention: "sdpa" (HF's default; flash / memory-efficient kernels) and "flash_attention_2" keep no
    (B, a, T, T) probabilities for backward, "eager" does (the attention mask: mask_bytes). lora: the rank
    r of LoRA adapters on every block linear (toolkit.plan.lora), the base frozen; None trains every parameter."""
    check_shape(arch, seq_len, mbs)
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention {attention!r} is not one of {', '.join(ATTENTIONS)}")
    weight_bytes(precision)  # refuses an unknown precision
    p = PRECISIONS[precision]
    adapters = lora_params(arch, lora) if lora is not None else None
    costs, inactive = [], layer_inactive_params(arch)
    for i, (name, params, tied) in enumerate(layer_params(arch)):
        kind = name.split(".")[0]
        moe = kind == "block" and arch.moe_block(int(name.split(".")[1]))
        if adapters is None:
            fwd = _fwd_flops(arch, kind, mbs, seq_len, moe)
            total = fwd + 2 * mbs * seq_len * arch.hidden if kind == "embed" else 3 * fwd
            trainable = params
        else:
            fwd, total = _lora_flops(arch, kind, mbs, seq_len, lora, moe)
            params, trainable = params + adapters[i], adapters[i]
        states = params * p.param + trainable * (p.grad + p.optim)  # all E experts: every rank holds them
        acts = _act_bytes(arch, kind, mbs, seq_len, p.act, attention, moe)
        peak = loss_peak_bytes(arch, seq_len, mbs) if kind == "head" else 0
        mlp = mlp_act_bytes(arch, mbs * seq_len, p.act) if kind == "block" and not moe else 0
        backward = mlp_backward_bytes(arch, mbs * seq_len, p.act) if kind == "block" and not moe else 0
        costs.append(LayerCost(name, kind, _typename(arch, kind), params, tied, fwd, total, states, acts, trainable,
                               peak, inactive[i], mlp, backward))
    return costs


def check_shape(arch: Arch, seq_len: int, mbs: int) -> None:
    for flag, value in (("--seq-len", seq_len), ("--mbs", mbs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    if seq_len > arch.max_positions:
        raise ConfigError(f"--seq-len {seq_len} exceeds {arch.name}'s max_positions ({arch.max_positions}); "
                          f"use --seq-len {arch.max_positions} or less")


def mask_bytes(seq_len: int, mbs: int = 1, precision: str = "bf16", attention: str = "sdpa") -> int:
    """Bytes of one (mbs, 1, T, T) attention mask in the activations' dtype (module docstring); 0 for flash."""
    return 0 if attention == "flash_attention_2" else PRECISIONS[precision].act * mbs * seq_len * seq_len


def boundary_bytes(arch: Arch, seq_len: int, mbs: int = 1, precision: str = "bf16") -> int:
    """Bytes of the hidden states one stage sends the next per micro-batch: (mbs, seq_len, h)."""
    return mbs * seq_len * arch.hidden * PRECISIONS[precision].act
