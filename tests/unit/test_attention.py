"""Attention inputs on the GPU path (models/attention.py), checked on CPU with real models:
- a pipeline stage's forward and backward read no value of a tensor (no .item(), int(), .tolist() or
  bool(): each is a host sync on a GPU) and build each mask kind once per micro-batch, not per block;
- flash_attention_2 with packed rows and micro-batch > 1 keeps documents apart, through the pipeline and
  through the HF model at pp = 1. flash-attn cannot run here: a stand-in computes what flash-attn's kernels
  compute (the variable-length kernel over cu_seq_lens, else causal attention over each whole row), so
  the check is that dstk hands transformers' flash path the arguments that keep documents apart;
- at pp = 1 under sdpa, every layer of a kind gets one additive mask of the micro-batch (HF's own, made
  additive once by models.attention.share_additive_masks), not a bool one torch converts at every layer: the
  same loss and gradients, L - 1 masks fewer held for backward, in the engine's dtype.
"""

import pytest
import torch
import torch.nn.functional as F

import models
import models.attention
from models.attention import model_inputs
from toolkit.train.parity import (TOLERANCE, batch, ensure_world_of_one, packed_batch, packed_vs_alone,
                                  small_model)

DENSE = {"llama": {}, "gpt2": {}, "qwen2": {}, "gpt_neox": {}, "mistral": {"sliding_window": 4},
         "gemma3_text": {"sliding_window": 4, "num_hidden_layers": 6}, "phi3": {}}


def _stage(model_type, attention, **overrides):
    hf = small_model(model_type, attn_implementation=attention, **overrides)
    spec = models.pipeline_layers(hf)
    ensure_world_of_one()
    return hf, spec, models.build_pipeline_module(spec, num_stages=1)


def _refuse_reads(monkeypatch):
    def read(tensor, *args):
        raise AssertionError("a forward pass read a tensor's value (a host sync on a GPU)")

    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, read)


@pytest.mark.parametrize("model_type, attention", [(m, "sdpa") for m in DENSE] + [("llama", "eager"),
                                                                                 ("gemma3_text", "eager")])
def test_a_stage_reads_no_tensor_value_and_builds_each_mask_once(ds_world1, monkeypatch, model_type, attention):
    hf, spec, module = _stage(model_type, attention, **DENSE[model_type])
    built = []
    real = models.attention.document_mask
    monkeypatch.setattr(models.attention, "document_mask", lambda *a: built.append(a[3]) or real(*a))
    padded, packed = batch(hf.config, spec.task, seq_len=16), packed_batch(hf.config)[:2]
    for inputs, labels in (padded, packed):
        built.clear()
        with monkeypatch.context() as m:
            _refuse_reads(m)
            spec.loss_fn(module(inputs), labels).backward()
        kinds = set(getattr(hf.config, "layer_types", None) or ["one"])  # gemma3: sliding and full layers
        assert len(built) == len(kinds), built  # once per micro-batch and kind, not per block


def test_stage_masks_equal_hf_on_padded_rows(ds_world1):
    """The rows' rule keeps HF's own result for a padded one-document row, padding positions included."""
    hf, spec, module = _stage("llama", "sdpa")
    inputs, labels = batch(hf.config, spec.task, seq_len=16)
    with torch.no_grad():
        assert (module(inputs) - hf(input_ids=inputs[0], attention_mask=inputs[1]).logits).abs().max() <= TOLERANCE


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"])
def test_the_mask_without_vmap_is_hfs_builder_with_the_rows_rule(monkeypatch, attention, kind):
    """document_mask evaluates the layer kind's rule and the rows' rule over broadcast indices: the very mask
    HF's builder makes of them through torch.vmap (hf_document_mask), for one-document rows whole or padded,
    packed rows with padding, and a filler row; and it never calls torch.vmap."""
    from transformers import LlamaConfig
    from transformers import masking_utils as mu

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=16)
    config.sliding_window, config.attention_chunk_size, config._attn_implementation = 3, 4, attention
    doc_ids = torch.tensor([[1] * 10, [1] * 7 + [0] * 3, [1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1] * 10,
                            [1, 2, 2, 2, 2, 2, 2, 4, 4, 4]])
    hidden = torch.zeros(*doc_ids.shape, 8, dtype=torch.bfloat16)
    want = models.attention.hf_document_mask(doc_ids, hidden, config, getattr(mu, kind))
    with monkeypatch.context() as m:
        m.setattr(torch, "vmap", lambda *a, **k: pytest.fail("torch.vmap called"))
        got = models.attention.document_mask(doc_ids, hidden, config, getattr(mu, kind))
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


def _flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                    cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """What transformers' flash_attention_2 computes without a padding mask: flash_attn_varlen_func over
    cu_seq_lens when given (the rows flattened into one sequence of documents), else flash_attn_func,
    causal over each whole row. q, k, v: (B, heads, T, D); returns (B, T, heads, D) like the real one."""
    assert attention_mask is None and dropout == 0.0
    rows, heads, length, dim = query.shape
    key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))  # grouped-query heads
    q, k, v = (x.transpose(1, 2).reshape(rows * length, heads, dim) for x in (query, key, value))
    if cu_seq_lens_q is None:
        bounds = list(range(0, rows * length + 1, length))
    else:
        bounds = cu_seq_lens_q.tolist()
        assert torch.equal(cu_seq_lens_q, cu_seq_lens_k) and cu_seq_lens_q.dtype == torch.int32
        assert isinstance(max_length_q, int) and max_length_q == max_length_k == max(
            b - a for a, b in zip(bounds, bounds[1:]))  # flash-attn takes the longest as a host int
    out = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                          scale=scaling).transpose(0, 1) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(out).reshape(rows, length, heads, dim), None


@pytest.fixture
def flash(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", _flash_stand_in)

    def as_flash(hf):
        hf.config._attn_implementation = "flash_attention_2"
        return hf
    return as_flash


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_flash_keeps_packed_documents_apart_at_micro_batch_2_in_a_pipeline(ds_world1, flash, model_type):
    hf, spec, module = _stage(model_type, "sdpa")
    flash(hf)
    inputs, labels, docs = packed_batch(hf.config)  # 2 rows: 3 documents + padding, 1 document + padding
    with torch.no_grad():
        logits = module(inputs)
        assert max(packed_vs_alone(logits, spec.loss_fn(logits, labels), hf, docs)) <= TOLERANCE


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_flash_keeps_packed_documents_apart_at_micro_batch_2_at_pp1(ds_world1, flash, model_type):
    """What toolkit.train.loop.forward_loss hands the HF model at pp = 1."""
    hf = flash(small_model(model_type))
    (ids, doc_ids), labels, docs = packed_batch(hf.config)
    with torch.no_grad():
        out = hf(input_ids=ids, labels=labels, **model_inputs(doc_ids, hf.config))
        assert max(packed_vs_alone(out.logits, out.loss, hf, docs)) <= TOLERANCE


def test_the_flash_stand_in_would_catch_documents_attending_to_each_other(ds_world1, flash):
    """Without the variable-length arguments (transformers' own path at batch size > 1) the documents mix."""
    hf = flash(small_model("llama"))
    (ids, doc_ids), labels, docs = packed_batch(hf.config)
    inputs = {k: v for k, v in model_inputs(doc_ids, hf.config).items() if not k.startswith(("cu_", "max_"))}
    with torch.no_grad():
        out = hf(input_ids=ids, labels=labels, **inputs)
        assert packed_vs_alone(out.logits, out.loss, hf, docs)[0] > 1e-2


def _loss_grads_masks(hf, batch, interfaces):
    """(loss, gradients, [(layer kind, mask)] each layer's attention got) of a pp = 1 forward and backward."""
    from toolkit.train.parity import grads_of
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((getattr(module, "sliding_window", None), attention_mask))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    interfaces["sdpa"] = spy
    (ids, doc_ids), labels = batch[:2]
    loss = hf(input_ids=ids, labels=labels, **model_inputs(doc_ids, hf.config)).loss
    loss.backward()
    return float(loss), grads_of(hf), seen


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma3_text"])
@pytest.mark.parametrize("rows", ["packed", "padded"])
def test_pp1_layers_share_one_additive_mask_per_kind(interfaces, model_type, rows):
    """pp = 1, sdpa: the HF model builds its masks (packed rows: positions restart per document; padded rows: the
    padding mask) once per layer kind; with dstk's builder (share_additive_masks, installed at engine start) the
    mask every layer of a kind gets is one additive (float) tensor, where torch would convert a bool one at
    every layer and keep each copy for backward. Loss and gradients are unchanged."""
    from toolkit.train.parity import packed_batch

    hf = small_model(model_type, attn_implementation="sdpa", **DENSE[model_type])
    made = packed_batch(hf.config) if rows == "packed" else batch(hf.config, "causal-lm", seq_len=16)
    want = _loss_grads_masks(hf, made, interfaces)
    models.attention.share_additive_masks(hf.config)
    loss, grads, seen = _loss_grads_masks(hf, made, interfaces)
    masks = {}
    for kind, mask in seen:
        assert isinstance(mask, torch.Tensor) and mask.dtype == torch.float32, (kind, mask)
        assert masks.setdefault(kind, mask) is mask  # the same tensor for every layer of the kind
    assert abs(loss - want[0]) <= TOLERANCE
    assert max(float((grads[n] - g).abs().max()) for n, g in want[1].items()) <= TOLERANCE


def test_a_pp1_engine_hands_every_layer_one_additive_mask_in_its_dtype(ds_world1, interfaces):
    """What toolkit.train does at pp = 1: engine.start_engine installs the builder, forward_loss runs the engine (bf16
    here: the mask in the activations' dtype, not the batch's or fp32)."""
    from tests.configs import ds_config
    from toolkit.distributed.topology import Topology
    from toolkit.train.engine import start_engine
    from toolkit.train.loop import forward_loss
    from toolkit.train.parity import packed_batch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hf = small_model("llama", attn_implementation="sdpa")
    engine, _ = start_engine(hf, {"pp": 1}, ds_config(2, 1, bf16=True), Topology(1))
    seen = []
    interfaces["sdpa"] = lambda module, q, k, v, mask, **kw: seen.append(mask) or sdpa_attention_forward(
        module, q, k, v, mask, **kw)
    engine.backward(forward_loss(engine, packed_batch(hf.config)[:2]))
    assert len(seen) == hf.config.num_hidden_layers and all(mask is seen[0] for mask in seen)
    assert seen[0].dtype == torch.bfloat16 and seen[0].shape == (2, 1, 16, 16)


def test_pp1_packed_rows_hold_one_mask_for_backward_not_one_per_layer(interfaces):
    """The bytes a pp = 1 forward leaves held for backward (what torch's ops allocate, tests/unit/test_costs.py's
    LiveBytes): with HF's bool mask torch keeps an additive copy per layer; with share_additive_masks one, so
    L - 1 masks (B x T x T x 4 bytes in fp32) fewer."""
    from tests.unit.test_costs import LiveBytes
    from toolkit.train.parity import packed_batch

    hf = small_model("llama", attn_implementation="sdpa", num_hidden_layers=4, max_position_embeddings=256)
    (ids, doc_ids), labels, _ = packed_batch(hf.config, rows=((100, 156), (30, 200, 26)), seq_len=256)
    held = []
    for shared in (False, True):
        if shared:
            models.attention.share_additive_masks(hf.config)
        with LiveBytes() as live:
            loss = hf(input_ids=ids, labels=labels, **model_inputs(doc_ids, hf.config)).loss
            held.append(live.live)
            loss.backward()
    assert held[0] - held[1] == (4 - 1) * 2 * 256 * 256 * 4
