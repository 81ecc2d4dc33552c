"""Ulysses' core attention on CUDA (toolkit.distributed.document_flex: flex_attention with one document BlockMask
per micro-batch), checked on CPU as far as CPU can: there is no GPU here, and torch 2.13 has no flex_attention
backward on CPU. So the flex path is forced on (`_use_flex`, which stands in for the CUDA check) and its forward
runs under no_grad with eager flex_attention standing in for the compiled one (compiling on CPU takes half a
minute a graph). Eager flex_attention evaluates the rule over every element and ignores the BlockMask's blocks,
so the blocks are checked on their own: every element a block marks full is allowed by the rule, and every
allowed element lies in a listed block. Not checked here: the compiled CUDA kernel, its backward, recompiles.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from models.attention import Documents, model_inputs
from toolkit.distributed import document_flex, sequence_parallel
from toolkit.distributed.sequence_parallel import attention_for_ulysses, document_sdpa, shard
from toolkit.train.parity import TOLERANCE, packed_batch, small_model

CASES = {  # rows[r] = (0, starts ..., T) of 36 tokens: padding is a document of its own, as Documents has it
    "packed": ((0, 9, 12, 24, 28, 36), (0, 20, 26, 36)),
    "one document a row": ((0, 36), (0, 36)),
    "one document then padding": ((0, 29, 36), (0, 36)),
    "tiny documents": ((0, 1, 2, 3, 35, 36), (0, 17, 18, 36)),
}


pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _force_flex(monkeypatch):
    """The flex path forced on (it runs where query.is_cuda), eager flex_attention for the compiled one."""
    monkeypatch.setattr(sequence_parallel, "_use_flex", lambda query: True)
    monkeypatch.setattr(document_flex, "flex_attention", lambda: flex_attention)


@pytest.fixture
def flex(monkeypatch):
    _force_flex(monkeypatch)


def _module(groups):
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, groups, False
    return module


@pytest.mark.parametrize("window", [None, 5, 13])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_flex_gives_the_document_loops_output(monkeypatch, case, kv_heads, window):
    """Forward: the per-document sdpa loop's output (causal inside each document, the window's keys), GQA or
    not, with the layer's scale; (B, T, heads, hs) as HF's sdpa returns it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 36, 8, generator=g) for n in (4, kv_heads, kv_heads))
    kwargs = {"dropout": 0.0, "scaling": 0.3, "sliding_window": window}
    built, real = [], document_flex.build_block_mask
    monkeypatch.setattr(document_flex, "build_block_mask", lambda *a: built.append(a) or real(*a))
    with torch.no_grad():
        want, _ = document_sdpa(_module(4 // kv_heads), q, k, v, None, documents=Documents(CASES[case]), **kwargs)
        assert not built  # on CPU: the loop
        with monkeypatch.context() as m:
            _force_flex(m)
            got, _ = document_sdpa(_module(4 // kv_heads), q, k, v, None, documents=Documents(CASES[case]), **kwargs)
    assert built, "the flex path did not run"
    assert got.shape == want.shape == (2, 36, 4, 8) and got.is_contiguous()
    assert (got - want).abs().max() <= 1e-5


def _allowed(rows, window, length):
    """(B, T, T) bool: the rule, element by element."""
    ids = document_flex.document_ids(rows)
    q, kv = torch.arange(length)[:, None], torch.arange(length)[None, :]
    near = (q >= kv) & ((q - kv < window) if window is not None else True)
    return (ids[:, :, None] == ids[:, None, :]) & near


@pytest.mark.parametrize("window", [None, 3, 8, 11, 100])
@pytest.mark.parametrize("size", [4, 8, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_blocks_hold_every_allowed_element_and_full_ones_no_other(case, size, window):
    """The blocks the kernel visits: full (no rule applied) exactly where every element is allowed (a block cut by
    T, 36 tokens, never: as create_block_mask); every allowed element in a full or partial block, and without a
    window no partial block without one (with a window a partial block may hold none: the rule masks it)."""
    rows = CASES[case]
    partial, full = document_flex.blocks(document_flex.document_ids(rows), window, size)
    blocks = -(-36 // size)
    allowed = torch.nn.functional.pad(_allowed(rows, window, 36), (0, blocks * size - 36, 0, blocks * size - 36))
    tiles = allowed.reshape(2, blocks, size, blocks, size).transpose(2, 3)  # (B, i, j, size, size)
    assert torch.equal(full[:, 0], tiles.all(-1).all(-1))
    some = tiles.any(-1).any(-1)
    assert not (some & ~(partial | full)[:, 0]).any() and not (partial & full).any()
    if window is None:
        assert torch.equal(some, (partial | full)[:, 0])


def test_the_block_mask_gives_flex_its_layout():
    """build_block_mask's BlockMask: what flex_attention reads (shape, the rule, the blocks in order)."""
    mask = document_flex.build_block_mask(CASES["packed"], 5, "cpu", size=8)
    assert mask.shape == (2, 1, 36, 36) and mask.BLOCK_SIZE == (8, 8)
    dense = mask.to_dense()  # partial and full blocks, (B, 1, blocks, blocks)
    partial, full = document_flex.blocks(document_flex.document_ids(CASES["packed"]), 5, 8)
    assert torch.equal(dense.bool(), partial | full)
    assert torch.equal(mask.mask_mod(torch.tensor(0), 0, torch.tensor(9), torch.tensor(8)), torch.tensor(False))
    assert torch.equal(mask.mask_mod(torch.tensor(0), 0, torch.tensor(16), torch.tensor(12)), torch.tensor(True))
    assert torch.equal(mask.mask_mod(torch.tensor(0), 0, torch.tensor(18), torch.tensor(12)), torch.tensor(False))


def test_dropout_and_non_causal_layers_take_the_loop():
    """What flex would compute otherwise than HF's sdpa goes through the loop."""
    module = _module(1)
    assert document_flex.supported(module, {"dropout": 0.0, "scaling": None})
    assert not document_flex.supported(module, {"dropout": 0.1})
    assert not document_flex.supported(module, {"is_causal": False})
    module.is_causal = False
    assert not document_flex.supported(module, {})


LAYERS = {"llama": {}, "mistral": {"sliding_window": 5},
          "gemma3_text": {"sliding_window": 5, "num_hidden_layers": 3,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}}


@pytest.mark.parametrize("model_type", list(LAYERS))
def test_one_block_mask_per_micro_batch_and_window_shared_by_the_layers(interfaces, monkeypatch, flex, model_type):
    """A model's forward under Ulysses' core (sp 1): the BlockMask is built once per micro-batch and window, not
    per layer, and the loss is the loop's."""
    hf = small_model(model_type, attn_implementation="sdpa", **LAYERS[model_type])
    (ids, doc_ids), labels, _ = packed_batch(hf.config, rows=((9, 3, 12, 4), (20, 6)), seq_len=32)
    with torch.no_grad():
        want = hf(input_ids=ids, labels=labels, **model_inputs(doc_ids, hf.config)).loss
    attention_for_ulysses("sdpa")
    built, real = [], document_flex.build_block_mask
    monkeypatch.setattr(document_flex, "build_block_mask", lambda *a: built.append(a[1]) or real(*a))
    with torch.no_grad():
        for _ in range(2):  # two micro-batches
            got = hf(**shard(((ids, doc_ids), labels), 1, 0)).loss
    windows = {getattr(hf.config, "sliding_window", None) if model_type == "mistral" else None}
    if model_type == "gemma3_text":
        windows = {5, None}
    assert sorted(built, key=str) == sorted(list(windows) * 2, key=str)
    assert abs(float(got) - float(want)) <= TOLERANCE


@pytest.mark.heavy
def test_compiled_flex_reads_the_blocks_and_compiles_once_per_window(monkeypatch):
    """flex_attention compiled as on CUDA, by inductor's CPU backend here (~15 s): it skips the blocks the
    BlockMask leaves out and applies no rule in full ones (a wrong block changes its output: checked by mutation),
    so its forward equal to the loop's checks the blocks in a kernel; and it compiles one graph per window, not
    one per micro-batch (T 256: two 128-token blocks a side)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(document_flex, "_compiled", [])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 256, 16, generator=g) for n in (4, 2, 2))
    micro_batches = [((0, 100, 130, 256), (0, 256)), ((0, 7, 200, 256), (0, 50, 256)), ((0, 256), (0, 256))]
    graphs = counters["stats"]["unique_graphs"]
    for window in (None, 40):
        for rows in micro_batches:
            kwargs = {"dropout": 0.0, "scaling": 0.25, "sliding_window": window}
            with torch.no_grad():
                want, _ = document_sdpa(_module(2), q, k, v, None, documents=Documents(rows), **kwargs)
                with monkeypatch.context() as m:
                    m.setattr(sequence_parallel, "_use_flex", lambda query: True)
                    got, _ = document_sdpa(_module(2), q, k, v, None, documents=Documents(rows), **kwargs)
            assert (got - want).abs().max() <= 1e-5, (window, rows)
    assert counters["stats"]["unique_graphs"] - graphs == 2
