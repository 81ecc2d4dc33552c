"""Attention under Ulysses sequence parallelism on the GPU path (toolkit.distributed.sequence_parallel), checked on
CPU with real HF models called with the keyword arguments dstk's `shard` gives them and the attention functions
`attention_for_ulysses` installs (what `register` installs before Ulysses wraps the core, process-wide in a rank;
restored after each test here). At sp 1 the core sees the whole rows, as after Ulysses' all-to-all (also run:
DeepSpeed's UlyssesSPAttentionHF over this process's group of one).
- HF builds no mask for a rank's slice (Ulysses would drop it) and reads no position to look for documents;
- a sliding-window layer never gets a (T x T) mask: blocks of queries over their window of keys, exact;
- the documents' bounds are computed once per micro-batch (on the host, in `shard`), never in a layer: a
  forward and backward read no tensor value, and the loss and gradients are one process's.
"""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import models.attention
from models.attention import model_inputs
from toolkit.distributed import sequence_parallel
from toolkit.distributed.sequence_parallel import attention_for_ulysses, document_sdpa, shard
from toolkit.train.parity import TOLERANCE, grads_of, packed_batch, small_model

WINDOWED = {"llama": {}, "mistral": {"sliding_window": 5}, "gemma3_text": {"sliding_window": 5,
                                                                         "num_hidden_layers": 2}}
ROWS = ((9, 3, 12, 4), (20, 6))  # documents per row: longer and shorter than the window, padding at the end


def _refuse_reads(monkeypatch, unless=lambda: False):
    """Reading a tensor's value (a host sync on a GPU) fails the test, except while unless() holds."""
    def refuse(name):
        real = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            if not unless():
                raise AssertionError("a forward or backward read a tensor's value (a host sync on a GPU)")
            return real(tensor, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


def _batch(config):
    (ids, doc_ids), labels, _ = packed_batch(config, rows=ROWS, seq_len=32)
    return (ids, doc_ids), labels


@pytest.mark.parametrize("model_type", list(WINDOWED))
def test_hf_builds_no_mask_for_a_slice_and_reads_no_position(interfaces, monkeypatch, model_type):
    """Each rank's slice holds document starts: HF would build a (B, 1, T/sp, T/sp) bool mask from the slice's
    positions (a host read to find them), which Ulysses drops."""
    from transformers import masking_utils as mu

    hf = small_model(model_type, attn_implementation="sdpa", **WINDOWED[model_type])
    batch = _batch(hf.config)
    attention_for_ulysses("sdpa")
    seen = []

    def core(module, query, key, value, attention_mask, **kwargs):  # stands for Ulysses' wrapper: records the mask
        seen.append(attention_mask)
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    interfaces["sdpa"] = core
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda *a: pytest.fail("HF looked for documents"))
    for rank in range(2):
        inputs = shard(batch, 2, rank)
        with monkeypatch.context() as m:
            _refuse_reads(m)
            hf(**inputs)
    assert len(seen) == 2 * hf.config.num_hidden_layers and all(mask is None for mask in seen), \
        [None if m is None else (m.shape, m.dtype) for m in seen]


def _qkv(rows=2, heads=4, kv_heads=2, length=32, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, n, length, 8, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads)]


def _module():
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 2, False
    return module


@pytest.mark.parametrize("block, window", [(1024, 5), (3, 5), (4, 4), (2, 7)])
def test_a_sliding_window_runs_in_blocks_with_no_sequence_square_mask(monkeypatch, block, window):
    """A window shorter than the documents: the outputs and gradients of attention with HF's whole (B, 1, T, T)
    mask (causal, inside each document, the last `window` keys), and no mask longer than a block of queries
    over its window of keys."""
    from models.attention import positions

    (_, doc_ids), _ = _batch(small_model("llama").config)
    position_ids = positions(doc_ids)
    docs = position_ids.eq(0).cumsum(1)  # a document starts where its position is 0
    index = torch.arange(32)
    near = (index[:, None] >= index[None, :]) & (index[:, None] - index[None, :] < window)
    mask = near & (docs[:, None, :, None] == docs[:, None, None, :])
    q, k, v = _qkv()
    want, _ = sdpa_attention_forward(_module(), q, k, v, mask, dropout=0.0, scaling=None)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))

    shapes, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: shapes.append(None if attn_mask is None else
                                                                       tuple(attn_mask.shape[-2:])) or
                        real(*a, attn_mask=attn_mask, **kw))
    monkeypatch.setattr(sequence_parallel, "BLOCK", block)
    got, _ = document_sdpa(_module(), q, k, v, None, position_ids=position_ids, sliding_window=window, dropout=0.0,
                           scaling=None)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert (got - want).abs().max() <= 1e-6
    assert max((a - b).abs().max() for a, b in zip(got_grads, want_grads)) <= 1e-5
    step = min(block, window)
    masked = [s for s in shapes if s is not None]
    assert masked and all(q_len <= step and k_len <= step + window for q_len, k_len in masked), shapes


def _ulysses(interfaces, config):
    """DeepSpeed's UlyssesSPAttentionHF around the installed core over this process's group of one (its
    all-to-alls and position gather run, with one rank), called as register_with_transformers' wrapper calls it."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    ulysses = UlyssesSPAttentionHF(interfaces["sdpa"], 2, config.num_attention_heads, config.head_dim,
                                   config.num_key_value_heads, config.num_hidden_layers, dist.group.WORLD,
                                   seq_length_is_variable=True)
    interfaces["sdpa"] = lambda module, q, k, v, mask, *args, **kwargs: ulysses(module, q, k, v, None, *args, **kwargs)


@pytest.mark.parametrize("model_type", list(WINDOWED))
@pytest.mark.parametrize("ulysses", [False, True])
def test_documents_are_found_once_per_micro_batch_and_the_loss_is_one_process(ds_world1, interfaces, monkeypatch,
                                                                              model_type, ulysses):
    """dstk's sp path at sp 1 (the core sees the whole rows, as after Ulysses' all-to-all; also through Ulysses
    itself): the documents' bounds are computed in `shard`, on the host, never in a layer's forward or backward,
    which read no tensor value; loss and gradients equal the one-process model's with HF's own masks."""
    hf = small_model(model_type, attn_implementation="sdpa", **WINDOWED[model_type])
    (ids, doc_ids), labels = _batch(hf.config)
    want = hf(input_ids=ids, labels=labels, **model_inputs(doc_ids, hf.config)).loss
    want.backward()
    want_grads = grads_of(hf)

    attention_for_ulysses("sdpa")
    if ulysses:
        _ulysses(interfaces, hf.config)
    monkeypatch.setattr(sequence_parallel, "BLOCK", 3)  # several blocks per windowed document
    found, real = [], models.attention.document_bounds
    monkeypatch.setattr(models.attention, "document_bounds", lambda *a: found.append(a) or real(*a))
    inputs = shard(((ids, doc_ids), labels), 1, 0)
    assert len(found) == 1
    with monkeypatch.context() as m:
        _refuse_reads(m)
        got = hf(**inputs).loss
        got.backward()
    assert len(found) == 1  # none in any layer
    assert abs(float(got) - float(want)) <= TOLERANCE
    got_grads = grads_of(hf)
    assert max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items()) <= TOLERANCE


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_stage_finds_the_documents_once_per_micro_batch(ds_world1, interfaces, monkeypatch, model_type):
    """pp > 1: a stage's blocks under Ulysses (`sequence_shard`) share one Documents per micro-batch, built by
    the first block from the document ids the stage received (its one device-to-host copy), not one per block;
    nothing else in the forward and backward reads a tensor value."""
    import models as wrappers
    from toolkit.train.parity import ensure_world_of_one

    hf = small_model(model_type, attn_implementation="sdpa", num_hidden_layers=3, **WINDOWED[model_type])
    (ids, doc_ids), labels = _batch(hf.config)
    with torch.no_grad():
        want = hf(input_ids=ids, labels=labels, **model_inputs(doc_ids, hf.config)).loss
    spec = wrappers.pipeline_layers(hf)
    ensure_world_of_one()
    module = wrappers.build_pipeline_module(spec, num_stages=1)
    for layer in module.forward_funcs:
        if hasattr(layer, "sequence_shard"):
            layer.sequence_shard = (1, 0)
    attention_for_ulysses("sdpa")
    found, real = [], models.attention.document_bounds

    def bounds(*args):
        found.append(args)
        try:
            return real(*args)
        finally:
            found[-1] = None  # done: reads refused again

    monkeypatch.setattr(models.attention, "document_bounds", bounds)
    with monkeypatch.context() as m:
        _refuse_reads(m, unless=lambda: found and found[-1] is not None)
        loss = spec.loss_fn(module((ids, doc_ids)), labels)
        loss.backward()
    assert len(found) == 1
    assert abs(float(loss) - float(want)) <= TOLERANCE


def test_flash_gets_the_documents_variable_lengths_once_per_micro_batch(interfaces):
    """Under flash (no flash kernel here: a stand-in for HF's flash_attention_forward records what it gets), the
    core gets cu_seq_lens / max_length of the whole rows from the Documents, the same tensors in every layer
    (built once per micro-batch), so transformers never reads the position ids to look for documents; they are
    flash's own arguments for the rows' document ids (models.attention.varlen_arguments)."""
    from models.attention import document_bounds, positions, varlen_arguments

    seen = []
    interfaces["flash_attention_2"] = flash = lambda module, q, k, v, mask, **kwargs: seen.append(kwargs) or (q, None)
    attention_for_ulysses("flash_attention_2")
    attention_for_ulysses("flash_attention_2")
    assert interfaces["flash_attention_2"].core is flash  # wrapped once
    (_, doc_ids), _ = _batch(small_model("llama").config)
    for row in (doc_ids[:1], doc_ids[1:]):  # mbs 1 under flash: two micro-batches
        documents = document_bounds(positions(row))
        q = torch.zeros(1, 4, 32, 8)
        for _layer in range(2):
            interfaces["flash_attention_2"](_module(), q, q, q, None, documents=documents, position_ids=positions(row))
        want = varlen_arguments(row)
        assert len(seen) == 2 and "documents" not in seen[0] and seen[0]["cu_seq_lens_q"] is seen[1]["cu_seq_lens_q"]
        assert torch.equal(seen[0]["cu_seq_lens_q"], want["cu_seq_lens_q"]), (seen[0], want)
        assert seen[0]["max_length_q"] == want["max_length_q"] and seen[0]["cu_seq_lens_k"].dtype == torch.int32
        seen.clear()
