"""The causal LM loss with the head inside it, in tiles of tokens: the logits (B, T, V) never exist whole.

A CausalLM forward turns the final hidden states (B, T, H) into logits (B, T, V), upcasts them to fp32 and takes
their cross entropy: at T = 32768 and V = 128256 that is 16 GiB of fp32 logits, and as much again for their
softmax and its gradient, per micro-batch. `tiled_head_loss` takes the summed cross entropy over tiles of at
most `tile_tokens(V)` tokens instead, keeping only the hidden states for the backward, which recomputes each
tile's logits and passes the incoming gradient through them to the hidden states and the head's weights
(a recompute, like TiledMLP: one more head matmul per step). DeepSpeed's TiledFusedLogitsLoss runs the backward
inside the forward with an incoming gradient of 1, which leaves the head's weight gradients unscaled by what
multiplies the loss afterwards (1 / gradient_accumulation_steps in the engine's backward, a loss scale, dstk's
token weights), so it is not used. The head's weight gradients are this function's own outputs, so autograd adds
them to the weights' other uses (a tied embedding) before the one accumulation ZeRO-2's buckets reduce. Under ZeRO-3
the weights are partitioned between uses (a function input's shape would be its empty partition): there each tile's
recompute goes through the head's module, which ZeRO gathers, and backpropagates into the weights' own gradients,
ZeRO's bucket taking them once, after the last tile (DeepSpeed's TiledMLP's way, ds_grad_is_ready).

Where it applies: `patch_causal_lm` (pp = 1: the HF model's own forward, its base model then the head) and the
last stage of a pipeline (toolkit.distributed.pipeline: the head layer passes the hidden states, the loss takes
the head). The loss equals HF's to fp32 rounding: a sum over tiles in another order.
"""

import functools
import types

IGNORE = -100  # the labels the loss skips (HF's and torch's convention)
TILE_BYTES = 64 * 2**20  # fp32 logits of one tile; with their log-softmax and both gradients 4x this at the peak
MIN_TILE = 256  # tokens: smaller tiles would starve the head's matmul


AUTO_BYTES = 2**29  # --tiled-loss auto: on from 512 MiB of a micro-batch's fp32 logits (Llama 3's 128K vocabulary:
# 1024 tokens), where the logits, their softmax and its gradient (about 1.5 GiB) outweigh one more head matmul (about
# 2% of a Llama-3-8B step)


def choose(mode: str, tokens: int, vocab: int, blocker: str | None = None) -> tuple:
    """(on, why) for --tiled-loss `mode` (auto, on, off) on a rank whose micro-batch holds `tokens` tokens (mbs x
    seq-len / sp) before a head of `vocab` outputs; `blocker`: why this run's loss cannot be tiled, if so
    (`--tiled-loss on` is then refused)."""
    from models.tiled import choose_mode, size_words

    need = logits_bytes(tokens, vocab)
    size = f"a micro-batch's logits are {size_words(need)} in fp32"
    return choose_mode("--tiled-loss", mode, need, size, blocker, AUTO_BYTES)


def tile_tokens(vocab: int) -> int:
    """Tokens per tile for a head of `vocab` outputs."""
    return max(MIN_TILE, TILE_BYTES // (4 * vocab))


def logits_bytes(tokens: int, vocab: int) -> int:
    """The fp32 logits of `tokens` tokens: what one untiled loss holds (and about as much again for the softmax)."""
    return 4 * tokens * vocab


@functools.cache
def _tiled_function():
    """TiledHeadLoss, made on first use (torch imported then)."""
    import torch
    import torch.nn.functional as F

    class TiledHeadLoss(torch.autograd.Function):
        """sum over tokens of cross_entropy(head(x).float(), targets), ignoring IGNORE, in tiles of `tile` tokens.
        x (N, H), targets (N,); `params`: the head's weights, inputs of this function: their gradients, summed over
        the tiles, are returned as theirs, so autograd adds them to the weights' other uses (a tied embedding) and
        accumulates each weight's gradient once, as without tiles (ZeRO-2's buckets reduce a gradient once)."""

        @staticmethod
        def forward(ctx, head, x, targets, tile, partitioned, *params):
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            with torch.no_grad():
                for start in range(0, x.shape[0], tile):
                    logits = head(x[start:start + tile]).float()
                    total += F.cross_entropy(logits, targets[start:start + tile], ignore_index=IGNORE, reduction="sum")
            ctx.head, ctx.tile, ctx.partitioned = head, tile, partitioned
            ctx.save_for_backward(x, targets, *params)
            return total

        @staticmethod
        def backward(ctx, grad):
            if ctx.partitioned is not None:
                return (None, partitioned_backward(ctx, grad, *ctx.partitioned), None, None, None)
            x, targets, *params = ctx.saved_tensors
            wants_x = ctx.needs_input_grad[1]
            trained = [i for i, wants in enumerate(ctx.needs_input_grad[5:]) if wants]
            x_grad = torch.zeros_like(x) if wants_x else None
            sums = [None] * len(params)
            for start in range(0, x.shape[0], ctx.tile):
                piece = x[start:start + ctx.tile].detach().requires_grad_(wants_x)
                with torch.enable_grad():
                    logits = ctx.head(piece).float()
                    loss = F.cross_entropy(logits, targets[start:start + ctx.tile], ignore_index=IGNORE, reduction="sum")
                inputs = ([piece] if wants_x else []) + [params[i] for i in trained]
                if not inputs:
                    break
                got = list(torch.autograd.grad(loss, inputs, grad, allow_unused=True))
                if wants_x:
                    x_grad[start:start + ctx.tile] = got.pop(0)
                for i, g in zip(trained, got):
                    if g is not None:  # summed in place: one copy of each weight's gradient beside the next tile's
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
                got = g = logits = loss = piece = None  # nothing of this tile held through the next one's peak
            return (None, x_grad, None, None, None, *sums)

    def partitioned_backward(ctx, grad, params, tied):
        """ZeRO-3's: each tile's recompute through the head's module (ZeRO gathers its weights) and a backward into
        the weights' own gradients, as DeepSpeed's TiledMLP does, ZeRO's bucket taking them after the last tile only
        (ds_grad_is_ready); a tied weight's after its other use too, in the outer backward."""
        x, targets = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[1]
        trained = [p for p in params if p.requires_grad]
        x_grad = torch.zeros_like(x) if wants_x else None
        starts = range(0, x.shape[0], ctx.tile)
        for start in starts:
            for p in trained:
                p.ds_grad_is_ready = start == starts[-1] and not tied
            piece = x[start:start + ctx.tile].detach().requires_grad_(wants_x)
            with torch.enable_grad():
                logits = ctx.head(piece).float()
                loss = F.cross_entropy(logits, targets[start:start + ctx.tile], ignore_index=IGNORE, reduction="sum")
            inputs = ([piece] if wants_x else []) + trained
            if inputs:
                torch.autograd.backward(loss, grad, inputs=inputs)
            if wants_x:
                x_grad[start:start + ctx.tile] = piece.grad
        for p in trained:
            p.ds_grad_is_ready = True
        return x_grad

    return TiledHeadLoss


def tiled_head_loss(head, hidden, shift_labels, vocab: int, tied: bool = False):
    """The summed cross entropy of head(hidden) against `shift_labels` (the label of the next token at each
    position, IGNORE where none), hidden (B, T, H) or (N, H). `tied`: the head's weight is also the input
    embedding's (its ZeRO-3 gradient is then complete only after the embedding's backward)."""
    params = [p for p in _parameters(head) if p.is_floating_point()]
    x = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(x.device)
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitions: not inputs (module docstring)
        return _tiled_function().apply(head, x, targets, tile_tokens(vocab), (params, tied))
    return _tiled_function().apply(head, x, targets, tile_tokens(vocab), None, *params)


def _parameters(head) -> list:
    """The weights a head callable computes with: a module's, a HeadOnly's, a bound method's module, or those of
    the module a functools.partial binds first (DeepSpeed's tied head: partial(forward_fn, the tied module))."""
    owner = getattr(head, "__self__", head)
    if getattr(head, "func", None) is not None and getattr(head, "args", None):
        owner = head.args[0]
    return list(owner.parameters()) if hasattr(owner, "parameters") else []


def shifted(labels):
    """(B, T) labels -> the label each position predicts (the next token's), as HF's ForCausalLMLoss shifts."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=IGNORE)[:, 1:]


class HeadOnly:
    """The head of a HF causal LM as one callable on hidden states: its output embeddings, then what its forward
    does to logits (LogitTransform: softcap, scaling). Not a module: the head's weights keep their one owner."""

    def __init__(self, model, transform):
        self.proj, self.transform = model.get_output_embeddings(), transform

    def __call__(self, hidden):
        return self.transform(self.proj(hidden))

    def parameters(self):
        return self.proj.parameters()


def _decoder(model):
    """The base model a CausalLM's forward runs before its head (Llama4ForCausalLM names its prefix
    language_model but holds it as .model: get_decoder returns the CausalLM itself there)."""
    import torch

    for found in (model.get_decoder(), getattr(model, model.base_model_prefix, None), getattr(model, "model", None)):
        if isinstance(found, torch.nn.Module) and found is not model:
            return found
    raise ValueError(f"{type(model).__name__}: no base model found for the tiled loss")


def patch_causal_lm(model, transform) -> None:
    """Make `model` (a HF CausalLM, pp = 1) compute its training loss tiled: its forward runs the base model, then
    tiled_head_loss over the final hidden states, with HF's reduction (the sum over `num_items_in_batch` when
    given, sp's way; else the mean over the labelled tokens). Without labels, or in eval without grad, the
    model's own forward runs. The module tree, and so every parameter's name, is unchanged."""
    import torch

    own = type(model).forward
    weight = model.get_output_embeddings().weight
    vocab = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 holds a partition: its full shape
    head = HeadOnly(model, transform)
    decoder = _decoder(model)
    tied = model.get_input_embeddings().weight is weight

    def forward(self, input_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if labels is None and shift_labels is None:
            return own(self, input_ids=input_ids, **kwargs)
        kwargs.pop("logits_to_keep", None)
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        targets = shift_labels if shift_labels is not None else shifted(labels)
        total = tiled_head_loss(head, hidden, targets, vocab, tied)
        if num_items_in_batch is not None:
            loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
        else:
            loss = total / (targets != IGNORE).sum()
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
    model.dstk_tiled_loss = True


class TiledPipelineLoss:
    """A pipeline's last-stage loss with the head inside it (the head layer then passes the hidden states on:
    `tile_pipeline_head`), for the loss callables dstk's causal LM pipelines use: models.spec.causal_lm_loss (the
    mean over labelled tokens), a MoE model's RouterAux.loss_fn (+ its router aux loss, from the sums the stages
    carried), and sp's PipelineLoss (its `sp` x the slice's sum / the micro-batch's targets)."""

    def __init__(self, head, loss_fn, vocab: int):
        self.head, self.vocab = head, vocab
        owner = getattr(loss_fn, "__self__", None)
        self.aux = owner if owner is not None and hasattr(owner, "aux_loss") else None
        self.sp = getattr(loss_fn, "sp", None)

    def __call__(self, outputs, labels):
        hidden, stats = outputs if isinstance(outputs, tuple) else (outputs, None)
        if self.sp is not None:  # labels: (this slice's labels, shifted over the whole row; the micro-batch's targets)
            shift, targets = labels
            total = tiled_head_loss(self.head, hidden, shift, self.vocab)
            return total * self.sp / targets.to(total.device)
        shift = shifted(labels)
        loss = tiled_head_loss(self.head, hidden, shift, self.vocab) / (shift != IGNORE).sum().to(hidden.device)
        if self.aux is not None:
            loss = loss + self.aux.coef * self.aux.aux_loss(stats)
        return loss


def _pass_hidden(hidden):
    return hidden


def tile_pipeline_head(module, vocab: int) -> bool:
    """On the rank whose stage ends with the head (a PipelineModule, 1F1B): the head layer passes the hidden
    states on and the loss takes the head (TiledPipelineLoss). The head's weights stay where they were (its
    layer, or the tied embedding's), so names, checkpoints and tied-weight all-reduces are unchanged. Returns
    whether this rank holds the head."""
    import torch

    if getattr(module, "_local_stop", None) != len(module._layer_specs):
        return False
    head = module.forward_funcs[-1]
    if isinstance(head, torch.nn.Module):  # kept in its place: DeepSpeed saves and loads a layer's weights from there
        computes = types.MethodType(type(head).forward, head)
        head.forward = _pass_hidden
        head = computes
    else:  # the tied head's partial (its weights are saved with the embedding's layer)
        module.forward_funcs[-1] = _pass_hidden
    module.loss_fn = TiledPipelineLoss(head, module.loss_fn, vocab)
    return True
