"""The cost model against independent counts: torch's FlopCounterMode, the tensors autograd saves, and
the bytes the loss allocates at its peak (a dispatch mode that follows every storage ops create), on the
real layers models/ builds (small widths of real architectures, random weights)."""

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import models
from toolkit.plan.arch import BUILTINS, load_arch, to_hf_config
from toolkit.plan.cost.layers import layer_costs, logits_bytes
from toolkit.plan.memory.precision import PRECISIONS
from toolkit.errors import ConfigError
from toolkit.plan.cost.profile import build_layers, sample_batch

B, T = 2, 128


def _measure(name, attention):
    """Per layer: (fwd+bwd matmul FLOPs, bytes autograd saves for backward, excluding parameters)."""
    arch = replace(BUILTINS[name], layers=1, vocab=4096)  # real widths, one block, small vocab
    config = to_hf_config(arch)
    config._attn_implementation = attention
    spec = models.pipeline_layers(config)
    inputs, labels = sample_batch(spec.config, T, B)
    out, results = inputs, []
    for i, (fn, module) in enumerate(build_layers(spec.layers)):
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        x = _leaves(out)
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x)
            last = i == len(spec.layers) - 1
            loss = spec.loss_fn(out, labels) if last else sum(t.float().sum() for t in _floats(out))
            loss.backward()
        results.append((flops.get_total_flops(), sum(saved.values())))
        out = tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
    return arch, results


def _floats(x):
    return [t for t in (x if isinstance(x, tuple) else (x,)) if t.is_floating_point()]


def _leaves(x):
    if isinstance(x, tuple):
        return tuple(_leaves(t) for t in x)
    return x.detach().requires_grad_(True) if x.is_floating_point() else x


@pytest.mark.parametrize("name, attention", [("gpt2", "eager"), ("llama-3.2-1b", "eager"), ("bert-base", "eager"),
                                             ("llama-3.2-1b", "sdpa")])
def test_flops_and_activations_match_real_layers(name, attention):
    arch, measured = _measure(name, attention)
    costs = layer_costs(arch, T, B, precision="fp32", attention=attention)
    for cost, (flops, saved) in zip(costs, measured):
        if cost.kind in ("block", "head"):  # matmuls dominate: elementwise terms < 1% here
            assert cost.flops == pytest.approx(flops, rel=0.02), cost.name
        if cost.kind == "block":  # the activation formula follows what HF's modules save
            assert cost.act_bytes == pytest.approx(saved, rel=0.10), cost.name


def test_gpt2_closed_forms():
    """Hand arithmetic for GPT-2 124M at seq 512: block 24*N*h^2 + 4*T^2*h (+ small), head 2*N*h*V."""
    arch = load_arch("gpt2")
    h, n, v = 768, 512, 50257
    costs = layer_costs(arch, 512)
    block, head = costs[1], costs[-1]
    assert block.fwd_flops == pytest.approx(24 * n * h * h + 4 * n * n * h, rel=0.01)
    assert head.fwd_flops == pytest.approx(2 * n * h * v, rel=0.01)
    # at seq 512 the head alone is more than a quarter of the model's compute (the claim)
    assert head.flops / sum(c.flops for c in costs) > 0.25
    assert block.state_bytes == block.params * 16  # bf16 + fp32 master + Adam m, v
    assert layer_costs(arch, 512, precision="fp32")[1].state_bytes == block.params * 16
    assert sum(PRECISIONS["bf16"].__dict__.values()) - PRECISIONS["bf16"].act == 16


def test_costs_scale_with_micro_batch():
    one, four = layer_costs(load_arch("llama-3.2-1b"), 1024, 1), layer_costs(load_arch("llama-3.2-1b"), 1024, 4)
    assert [4 * c.flops for c in one] == pytest.approx([c.flops for c in four])
    assert [c.state_bytes for c in one] == [c.state_bytes for c in four]


def test_bad_shapes():
    arch = load_arch("gpt2")
    with pytest.raises(ConfigError, match="--seq-len 2048 exceeds gpt2's max_positions \\(1024\\)"):
        layer_costs(arch, 2048)
    with pytest.raises(ConfigError, match="--mbs must be a positive integer"):
        layer_costs(arch, 128, 0)
    with pytest.raises(ConfigError, match="precision 'fp8'"):
        layer_costs(arch, 128, precision="fp8")


def test_the_planner_counts_the_attention_mask_once_per_stage_and_micro_batch_in_flight():
    """mbs * T^2 * 2 bytes (bf16) per micro-batch in flight on each stage under sdpa (pp = 1: one for the
    model); none with flash."""
    from toolkit.plan.layouts.estimate import Layout
    from toolkit.plan.layouts.planner import PlanRequest, estimate_layout

    T, layout = 8192, Layout(pp=2, dp=1, zero=1, mbs=2, gas=8)
    held = {}
    for attention in ("sdpa", "flash_attention_2"):
        req = PlanRequest(model="llama-3.2-1b", gbs=16, gpus_per_node=2, gpu="h100-sxm", seq_len=T, attention=attention)
        held[attention] = estimate_layout(req, layout).activations  # the heaviest stage: 2 in flight
    assert held["sdpa"] - held["flash_attention_2"] == 2 * (2 * T * T * 2)  # 1 GiB: in flight x mbs * T^2 * bf16
    layout = Layout(pp=1, dp=2, zero=1, mbs=2, gas=4)  # pp = 1: HF's mask for the model, made additive once
    for attention in ("sdpa", "flash_attention_2"):
        req = PlanRequest(model="llama-3.2-1b", gbs=16, gpus_per_node=2, gpu="h100-sxm", seq_len=T, attention=attention)
        held[attention] = estimate_layout(req, layout).activations
    assert held["sdpa"] - held["flash_attention_2"] == 2 * T * T * 2  # one, not one per block (16)
    req = PlanRequest(model="llama-3.2-1b", gbs=16, gpus_per_node=2, gpu="h100-sxm", seq_len=T, rows="full")
    assert estimate_layout(req, layout).activations == held["flash_attention_2"]  # whole rows: sdpa's causal path


def test_whole_one_document_rows_build_no_mask_at_pp_1():
    """What rows="full" stands for: HF's mask builder, as dstk's pp 1 forward calls it (models.attention.model_inputs,
    share_additive_masks), returns no mask for unpadded one-document rows under sdpa, and a (B, 1, T, T) one for a
    padded row (the rest of a document longer than --seq-len)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.attention import model_inputs, share_additive_masks

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    share_additive_masks(model.config)
    masks = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    ids = torch.randint(0, 64, (1, 16))
    for docs in (torch.ones_like(ids), torch.tensor([[1] * 10 + [0] * 6])):
        model(input_ids=ids, labels=ids, **model_inputs(docs, model.config))
    hook.remove()
    assert masks[0] is None and masks[1].shape == (1, 1, 16, 16)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages torch's ops create while it is active (backward included): alive now, and at
    their peak. A storage counts until it is freed; an op's output on one of its inputs' storages (a view,
    an alias) is not new."""

    def __init__(self, skip: set = frozenset()):
        super().__init__()
        self.live, self.peak, self.sizes, self.skip = 0, 0, {}, skip  # skip: shapes not counted (weight gradients)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.sizes.keys() | given \
                    and tuple(t.shape) not in self.skip:
                storage = t.untyped_storage()
                self.sizes[storage.data_ptr()] = storage.nbytes()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, storage.data_ptr())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key):
        self.live -= self.sizes.pop(key)


def _head(dtype):
    """(head layer, loss_fn, its (B, T, h) input, labels, arch) of llama-3.2-1b's widths with a 4096 vocab;
    the head frozen: its weight's gradient is a model state, not the loss's."""
    arch = replace(BUILTINS["llama-3.2-1b"], layers=1, vocab=4096)
    spec = models.pipeline_layers(to_hf_config(arch))
    fn, module = build_layers(spec.layers)[-1]
    module.to(dtype).requires_grad_(False)
    x = torch.randn(B, T, arch.hidden, dtype=dtype, requires_grad=True)
    return fn, spec.loss_fn, x, sample_batch(spec.config, T, B)[1], arch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_peaks_at_three_fp32_logits_on_top_of_what_the_stage_holds(dtype):
    """A pipeline's last stage (DeepSpeed keeps its outputs, the logits, in a buffer): the logits are held, and
    the loss's forward and backward add 12 * N * V bytes at their peak (bf16 logits: 14 x N * V in all, where
    the planner had 4 x N * V); the same without the logits kept (pp = 1: dstk drops HF's output)."""
    fn, loss_fn, x, labels, arch = _head(dtype)
    [head] = [c for c in layer_costs(arch, T, B, precision="bf16" if dtype == torch.bfloat16 else "fp32")
              if c.kind == "head"]
    e, nv = torch.finfo(dtype).bits // 8, B * T * arch.vocab
    with LiveBytes() as kept:
        logits = fn(x)
        held = kept.live
        loss_fn(logits, labels).backward()
    assert held == pytest.approx(logits_bytes(arch, T, B, e), rel=0.01)  # + the (B, T, h) input: outside
    assert head.act_bytes - held == e * B * T * arch.hidden  # the input, saved by the matmul
    assert kept.peak - held == pytest.approx(head.peak_bytes, rel=0.02) and head.peak_bytes == 12 * nv
    with LiveBytes() as dropped:
        loss_fn(fn(x), labels).backward()
    assert dropped.peak == pytest.approx(head.peak_bytes, rel=0.02)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "gpt2"])
def test_a_blocks_backward_adds_two_intermediate_gradients_on_top_of_what_it_holds(name):
    """One dense block, forward then backward, fp32: what its backward allocates beyond what the forward left
    held (its saved tensors and output) is about two (tokens x I) tensors, the MLP's gradients (mlp_backward_bytes),
    which the planner had at 0; the stage's peak when it outweighs the loss's (a small vocabulary, long rows)."""
    arch = replace(BUILTINS[name], layers=1, vocab=4096)
    config = to_hf_config(arch)
    config._attn_implementation = "sdpa"
    spec = models.pipeline_layers(config)
    inputs, _ = sample_batch(spec.config, T, B)
    layers = build_layers(spec.layers)
    x = _leaves(layers[0][0](inputs))
    shapes = {s for p in layers[1][1].parameters() for s in (tuple(p.shape), tuple(reversed(p.shape)))}
    with LiveBytes(skip=shapes) as mode:  # the weights' gradients are model states
        out = layers[1][0](x)
        held = mode.live
        sum(t.float().sum() for t in _floats(out)).backward()
    [block] = [c for c in layer_costs(arch, T, B, precision="fp32") if c.kind == "block"]
    assert block.backward_bytes == 2 * 4 * B * T * arch.intermediate
    # gated (llama): 2.0 x (tokens x I) measured; GPT-2's gelu_new: 1.75 x, which the planner rounds up to 2
    assert 0.85 * block.backward_bytes <= mode.peak - held <= 1.05 * block.backward_bytes


def test_a_tiled_loss_peaks_at_four_fp32_tiles_and_its_input_gradient():
    """models.tiled.loss at pp 1 in fp32: its backward holds, per tile, the logits, their log-softmax, its gradient
    and the logits' gradient (4 fp32 (tile, V)), beside the (N, h) gradient of the hidden states it fills: what
    tiled_loss_peak counts (it had 3 tiles and no input gradient)."""
    from models.tiled.loss import tile_tokens, tiled_head_loss
    from toolkit.plan.layouts.long_sequences import tiled_loss_bytes

    vocab, tokens, h = 8192, 3 * tile_tokens(8192), 64
    head = torch.nn.Linear(h, vocab, bias=False).requires_grad_(False)
    x = torch.randn(1, tokens, h, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens))
    with LiveBytes() as mode:
        tiled_head_loss(head, x, targets, vocab).backward()
    assert tiled_loss_bytes(tokens, vocab, h, 4) == 16 * tile_tokens(vocab) * vocab + 4 * tokens * h
    assert mode.peak == pytest.approx(tiled_loss_bytes(tokens, vocab, h, 4), rel=0.05)
    h = 1024  # a head that trains, wide enough that a copy of its gradient would show (32 MiB next to 256 MiB of
    head = torch.nn.Linear(h, vocab, bias=False)  # tiles): summed in place, the sum is its .grad, no copy beside it
    x = torch.randn(1, tokens, h, requires_grad=True)
    with LiveBytes() as trained:
        tiled_head_loss(head, x, targets, vocab).backward()
    weight = vocab * h * 4  # its .grad, which stays
    assert trained.peak - weight == pytest.approx(tiled_loss_bytes(tokens, vocab, h, 4), rel=0.05)
