"""What dstk train's long-sequence features change in a layout's estimate (toolkit.plan.layouts.estimate), decided
as dstk train decides them (models.tiled: the same torch-free choices): the tiled loss's peak instead of whole logits
(--tiled-loss), TiledMLP's shard instead of each block's MLP intermediates (--tiled-mlp), and the checkpointed block
inputs moved to host memory (--offload-activations). `model` is an estimate.Model, `lay` an estimate.Layout."""


def tiled_loss_peak(model, lay) -> int | None:
    """The loss's peak when dstk train tiles it on this layout (--tiled-loss, models.tiled.loss.choose on a rank's
    mbs x seq / sp tokens): tiled_loss_bytes; None when the loss is not tiled (DualPipeV's, a classifier's)."""
    from models.tiled.loss import choose

    if model.head_loss is None or lay.schedule == "dualpipev":  # as dstk train: not tiled there
        return None
    vocab, mode, _ = model.head_loss
    tokens = lay.mbs * model.tokens // lay.sp
    if not choose(mode, tokens, vocab)[0]:
        return None
    hidden_bytes = model.boundary // model.tokens  # e * h: one token's hidden state
    return tiled_loss_bytes(tokens, vocab, hidden_bytes, 1)


def tiled_loss_bytes(tokens: int, vocab: int, hidden: int, e: int) -> int:
    """What models.tiled.loss's backward allocates at its peak for `tokens` tokens (measured in
    tests/unit/test_costs.py): per tile the fp32 logits, their log-softmax, its gradient and the logits' gradient
    (4 fp32 (tile, V)), and the (tokens, hidden) gradient of the hidden states it fills (e bytes an element). A head
    that trains adds no copy: its gradient is summed over the tiles in place, in the tensor that becomes its .grad
    (the model states' gradient)."""
    from models.tiled.loss import tile_tokens

    return 4 * 4 * min(tokens, tile_tokens(vocab)) * vocab + e * tokens * hidden


def tiled_mlp_peak(model, lay, lo: int, hi: int) -> int:
    """The peak of a stage holding layers lo:hi when dstk train tiles their MLPs (--tiled-mlp, models.tiled.mlp.choose
    on a rank's mbs x seq / sp tokens): one shard's intermediates and the (tokens, h) input gradient TiledMLP fills;
    0 when they are not tiled (tp > 1, no dense MLP on the stage)."""
    from models.tiled.mlp import shards

    if not mlp_tiled(model, lay) or not any(model.tiled_mlp[4][lo:hi]):
        return 0
    _, hidden, _, _, per_layer = model.tiled_mlp
    tokens = lay.mbs * model.tokens // lay.sp
    rows = -(-tokens // shards(tokens, hidden))  # the largest shard
    return max(per_layer[lo:hi]) * rows // model.tokens + model.boundary // model.tokens * tokens


def mlp_tiled(model, lay) -> bool:
    """Whether dstk train tiles the dense MLPs on this layout (models.tiled.mlp.choose on a rank's mbs x seq / sp
    tokens, in the activations' dtype)."""
    from models.tiled.mlp import choose

    if model.tiled_mlp is None:
        return False
    mode, hidden, intermediate, gated, _ = model.tiled_mlp
    e = model.boundary // (model.tokens * hidden)  # bytes per activation element
    return choose(mode, lay.mbs * model.tokens // lay.sp, hidden, intermediate, e, gated, None,
                  model.tokens // lay.sp)[0]


def tiled_mlp_flops(model, lay, lo: int, hi: int) -> float:
    """FLOPs per sequence TiledMLP adds to layers lo:hi: each tiled MLP's forward once more, in the backward."""
    if not mlp_tiled(model, lay):
        return 0.0
    _, hidden, intermediate, gated, per_layer = model.tiled_mlp
    return sum(m > 0 for m in per_layer[lo:hi]) * (3 if gated else 2) * 2 * model.tokens * hidden * intermediate


def offloaded_checkpoints(model, lay, blocks: int, flight: int) -> tuple[int, int]:
    """(device bytes, host bytes) of the checkpointed inputs of a stage holding `blocks` layers with `flight`
    micro-batches in flight. Under --offload-activations (models.tiled.offload.choose on a GPU, for a rank's share of
    the model's blocks of mbs x seq / sp tokens) they go to host memory as the forward passes them, all but the
    newest (DeepSpeed's keep_last) and the one brought back for its layer's recompute: two stay on the device."""
    kept = model.boundary * lay.mbs / lay.sp * blocks * flight
    if model.offload is None or not lay.checkpointing:
        return kept, 0
    from models.tiled.offload import checkpoint_bytes, choose

    mode, decoder_blocks = model.offload
    per_token = model.boundary // model.tokens  # e * h
    held = checkpoint_bytes(lay.mbs * model.tokens // lay.sp, per_token, -(-decoder_blocks // lay.pp), 1)
    if not choose(mode, held, True, "cuda")[0]:
        return kept, 0
    device = model.boundary * lay.mbs / lay.sp * min(2, blocks * flight)
    return device, kept - device


def features(model, lay, host: int) -> tuple:
    """The long-sequence features dstk train turns on for this layout (`host`: bytes any stage offloads)."""
    on = ("tiled loss",) if tiled_loss_peak(model, lay) is not None else ()
    on += ("tiled MLP",) if mlp_tiled(model, lay) and any(model.tiled_mlp[4]) else ()
    return on + (("checkpoints in host memory",) if host else ())
