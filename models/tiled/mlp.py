"""The decoder blocks' MLP in shards of tokens, through DeepSpeed's TiledMLP: one shard's intermediates at a time.

A dense MLP holds several (tokens, intermediate) tensors for its backward (a gated one: the gate's and the up
projection's outputs, the activation's, their product): at 32768 tokens and Llama-3-8B's 14336 that is 3.5 GiB in
bf16, per block being backpropagated (with activation checkpointing: the block being recomputed). TiledMLP
(deepspeed.runtime.sequence_parallel.ulysses_sp) keeps only the MLP's input and runs the MLP shard by shard, in
the forward without grad and again in the backward, each shard's graph freed before the next: about 1/3 more
MLP FLOPs (one more forward) for a peak of one shard's intermediates. ALST's shards hold `hidden` tokens each
(ceil(seqlen / hidden) shards): a shard's intermediates are then about one MLP weight's size.

`patch_mlps` gives each dense MLP module an instance forward that calls TiledMLP with the module's own forward
as the function: peft's LoRA layers inside it still run, the module tree and parameter names are unchanged.
The input is flattened to (tokens, hidden) first, so the forward and the backward cut the same shards (TiledMLP
cuts the forward along dim -2 and the backward along the flattened rows), and the shard count given is the
number torch.chunk makes (TiledMLP marks a parameter's gradient ready for ZeRO's buckets, ds_grad_is_ready,
after shard number `shards`: fewer chunks would leave it unmarked). Every rank's micro-batches have the same
rows of seq_len tokens (toolkit.data.batches), so every rank cuts as many shards: ZeRO-3 gathers the weights once
per shard, on every rank alike. Each shard's random state is kept from the forward for its recompute (dropout).
Without grad (eval) the module's own forward runs whole. MoE blocks (experts, a router) are left as they are.
"""

import inspect
import math
import types

AUTO_BYTES = 2**30  # --tiled-mlp auto: on from 1 GiB of one block's MLP intermediates (Llama-3-8B in bf16: about
# 9400 tokens per micro-batch) for sequences longer than the hidden size (ALST's shard: shorter ones it leaves whole),
# where the peak it removes outweighs one more MLP forward per block (about 1/9 of a step's FLOPs at that length);
# short sequences in large micro-batches are a throughput setting, where the time is worth more than the memory
MLP_NAMES = ("mlp", "feed_forward", "ffn")  # a decoder block's attribute holding its MLP
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")  # ... beside its attention
MOE_PARTS = ("expert", "router")  # a submodule named so: an MoE block, not tiled


def saved_widths(gated: bool) -> int:
    """(tokens, intermediate) tensors a dense MLP keeps for its backward: gated (act(gate) * up): the gate's output,
    the activation's, the up projection's and the product; else the first linear's output and the activation's."""
    return 4 if gated else 2


def intermediate_bytes(tokens: int, intermediate: int, dtype_bytes: int, gated: bool = True) -> int:
    """What one block's MLP holds for its backward for `tokens` tokens, untiled."""
    return tokens * intermediate * dtype_bytes * saved_widths(gated)


def shard_tokens(hidden: int) -> int:
    """Tokens per shard (ALST: the hidden size, so ceil(tokens / hidden) shards): a shard's intermediates are then
    about one of the MLP's weights in size, and its matmuls (hidden x hidden x intermediate) still large."""
    return hidden


def shards(tokens: int, hidden: int) -> int:
    """The shards of `tokens` rows: as many as torch.chunk cuts (chunks of ceil(tokens / wanted) rows)."""
    wanted = max(1, math.ceil(tokens / shard_tokens(hidden)))
    return math.ceil(tokens / math.ceil(tokens / wanted))


def choose(mode: str, tokens: int, hidden: int, intermediate: int, dtype_bytes: int, gated: bool = True,
           blocker: str | None = None, sequence: int | None = None) -> tuple:
    """(on, why) for --tiled-mlp `mode` (auto, on, off) on a rank whose micro-batch holds `tokens` tokens (mbs x
    seq-len / sp), `sequence` of them per row (seq-len / sp; None: all), through MLPs of `intermediate` width;
    `blocker`: why this run's MLPs cannot be tiled, if so (`--tiled-mlp on` is then refused). The same answer on
    every rank: it reads the config, not the stage."""
    from models.tiled import choose_mode, size_words

    need = intermediate_bytes(tokens, intermediate, dtype_bytes, gated)
    size = f"a block's MLP holds {size_words(need)} of (tokens x {intermediate}) activations"
    sequence = tokens if sequence is None else sequence
    if mode == "auto" and blocker is None and need >= AUTO_BYTES and sequence <= hidden:
        return False, (f"{size}, but a row's {sequence} tokens fit one shard of {hidden} (ALST tiles longer rows); "
                       "--tiled-mlp on/off to choose")
    return choose_mode("--tiled-mlp", mode, need, size, blocker, AUTO_BYTES)


def decide(mode: str, model, config, tokens: int, dtype_bytes: int, blocker: str | None = None,
           sequence: int | None = None) -> tuple:
    """(on, why, shards) for --tiled-mlp `mode` (choose), for the dense MLPs of `model` (the run's whole model, or
    its skeleton on the meta device: every rank the same answer); `blocker` and `sequence` as choose's."""
    mlps = dense_mlps(model)
    if not mlps and blocker is None:
        blocker = (f"{type(model).__name__} has no dense MLP in its blocks (a module named {'/'.join(MLP_NAMES)} "
                   "beside the attention, no experts or router inside, called with the hidden states alone)")
    hidden, inner = widths(config)
    on, why = choose(mode, tokens, hidden, inner, dtype_bytes, bool(mlps) and is_gated(mlps[0][1]), blocker, sequence)
    return on, why, shards(tokens, hidden) if on else 0


def layout_blocker(tp: int) -> str | None:
    """Why a layout's MLPs are not tiled (None: they may be): AutoTP's sharded linears (tp > 1)."""
    if tp > 1:
        return (f"tp {tp}: the MLP's linears are AutoTP shards, whose collectives per shard dstk has not checked "
                "under TiledMLP")
    return None


def widths(config) -> tuple:
    """(hidden, intermediate) of a HF config's dense MLP (GPT-2: n_inner, else 4 x hidden)."""
    text = config.get_text_config()
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
    return hidden, getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden


def is_gated(mlp) -> bool:
    """act(gate(x)) * up(x) (Llama, Qwen, Gemma: gate_proj / up_proj, a fused gate_up_proj, w1 / w3)."""
    return any("gate" in name or "up" in name or name == "w3" for name, _ in mlp.named_children())


def dense_mlps(root) -> list:
    """[(name, module)]: the dense MLP of each decoder block under `root` (a HF model, a PeftModel, a pipeline
    stage): a block's `mlp` / `feed_forward` / `ffn` beside its attention, with no experts or router inside, whose
    forward takes the hidden states alone."""
    import torch

    found = []
    for name, block in root.named_modules():
        if not any(isinstance(getattr(block, a, None), torch.nn.Module) for a in ATTENTION_NAMES):
            continue
        for attr in MLP_NAMES:
            mlp = getattr(block, attr, None)
            if isinstance(mlp, torch.nn.Module) and _dense(mlp):
                found.append((f"{name}.{attr}" if name else attr, mlp))
    return found


def _dense(mlp) -> bool:
    if any(part in name.lower() for name, _ in mlp.named_modules() for part in MOE_PARTS):
        return False
    params = list(inspect.signature(_own_forward(mlp)).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind in positional]
    return len(required) == 1 and params[0].kind in positional


def _own_forward(mlp):
    """The module's forward before any patch of ours (an instance's own, else its class's), bound."""
    return getattr(mlp, "dstk_untiled_forward", None) or mlp.forward


def patch_mlps(root, hidden: int) -> int:
    """Give each dense MLP under `root` a forward through TiledMLP (shards of shard_tokens(hidden) tokens);
    returns how many were patched. Patching twice changes nothing."""
    mlps = dense_mlps(root)
    for _, mlp in mlps:
        if getattr(mlp, "dstk_untiled_forward", None) is None:
            mlp.dstk_untiled_forward = mlp.forward
            mlp.forward = types.MethodType(_tiled_forward(hidden), mlp)
    return len(mlps)


def _tiled_forward(hidden: int):
    def forward(self, x, *args, **kwargs):
        own = self.dstk_untiled_forward
        if args or kwargs or not _grad_enabled() or not x.requires_grad and not _any_grad(self):
            return own(x, *args, **kwargs)  # eval, or a call we do not know: the module's own forward, whole
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        rows = x.reshape(-1, x.shape[-1])  # (tokens, hidden): the same shards forward and backward
        if not rows.requires_grad:  # TiledMLP's output needs grad only through x: a frozen input (LoRA on the MLP
            rows = rows.detach().requires_grad_()  # alone) would leave the adapters without gradients
        count = shards(rows.shape[0], hidden)
        if count == 1:
            return own(x)
        params = [p for p in self.parameters() if p.requires_grad]  # LoRA's too; ZeRO-3's partitions
        out = TiledMLP.apply(ShardForward(own, self.training), self, rows, count, params)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _any_grad(module) -> bool:
    return any(p.requires_grad for p in module.parameters())


class ShardForward:
    """TiledMLP's `fn`: the module's own forward on one shard. In training each shard's random state (dropout,
    LoRA's dropout) is recorded as the forward runs it without grad and restored for its recompute in the
    backward, as torch.utils.checkpoint does, so the gradient is that of the output the forward gave."""

    def __init__(self, own, training: bool):
        self.own, self.training, self.states, self.next = own, training, [], 0

    def __call__(self, module, x):
        import torch

        if not self.training:
            return self.own(x)
        if not torch.is_grad_enabled():  # TiledMLP's forward: shard len(states)
            self.states.append(_rng_state(x.device))
            return self.own(x)
        outer = _rng_state(x.device)  # the backward's recompute: shard `next` draws as it did
        _set_rng_state(x.device, self.states[self.next])
        self.next = (self.next + 1) % len(self.states)
        try:
            return self.own(x)
        finally:
            _set_rng_state(x.device, outer)


def _rng_state(device) -> tuple:
    import torch

    accel = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), accel


def _set_rng_state(device, state: tuple) -> None:
    import torch

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)
