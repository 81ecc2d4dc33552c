"""Ulysses' core attention on CUDA: torch's flex_attention with one document BlockMask per micro-batch.

After Ulysses' all-to-all the core sees the whole rows (T tokens) for heads / sp heads. Attention is causal and
inside each document (models.attention.Documents: the rows' bounds, on the host), with a sliding window where
the layer has one. On CUDA this is one flex_attention call per layer over all rows, skipping the (128 x 128)
blocks no query of a block may see (another document, the future, outside the window): compute and memory
linear in the documents' lengths, no (T x T) mask, no Python loop over documents.

The BlockMask is built on the host from the bounds, once per micro-batch and window (kept in Documents.cache,
shared by every layer, the backward and the recompute of activation checkpointing), and copied to the device:
no device value is read. torch's create_block_mask would evaluate the rule over a (B, 1, T, T) bool tensor
unless compiled (16 GiB a row at T 131072); the bounds give the blocks directly: a block pair is full where
both blocks lie inside one document, the keys' block before the queries' and the window covering them all, and
partial (the rule `_rule` evaluated per element in the kernel) where the window may reach the keys' block and
its last document is not before the first document of the queries' block.

flex_attention is compiled once per process (torch.compile, dynamic=False: T and the rows are fixed in a run),
as torch's docs ask: eager flex_attention computes the whole (T x T) scores. Its graph is guarded on the rule's
closure, so a run compiles once per window size (gemma3: two) and per grad mode, not per micro-batch.
"""

import torch

BLOCK = 128  # tokens per side of a flex_attention block (torch's default sparse block size)
_compiled = []  # [the compiled flex_attention], once per process


def available() -> bool:
    """flex_attention importable (torch >= 2.5)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def supported(module, kwargs: dict) -> bool:
    """What the flex path computes as HF's sdpa does: causal attention (the module's, or kwargs' is_causal), no
    dropout (HF passes the config's attention_dropout while training, 0.0 in eval), no position bias, no softcap
    (HF's sdpa refuses it), no attention weights asked for."""
    causal = kwargs.get("is_causal")
    return ((getattr(module, "is_causal", True) if causal is None else causal) and not kwargs.get("dropout")
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions"))


def flex_attention():
    """torch.compile(flex_attention), once per process."""
    if not _compiled:
        from torch.nn.attention.flex_attention import flex_attention as flex

        _compiled.append(torch.compile(flex, dynamic=False))
    return _compiled[0]


def attention(query, key, value, documents, window, scale):
    """Causal attention inside each document of `documents` (and the last `window` keys, None: all) for query
    (B, heads, T, hs), key and value (B, kv heads, T, hs) (kv heads dividing heads: GQA) -> (B, T, heads, hs),
    the layout HF's sdpa_attention_forward returns."""
    mask = block_mask(documents, window, query.device)
    out = flex_attention()(query, key, value, block_mask=mask, scale=scale,
                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def block_mask(documents, window, device):
    """The micro-batch's BlockMask for `window` on `device`, built once (module doc) and kept in the Documents."""
    made = ("flex", window, str(device))
    if made not in documents.cache:
        documents.cache[made] = build_block_mask(documents.rows, window, device)
    return documents.cache[made]


def build_block_mask(rows: tuple, window, device, size: int = BLOCK):
    """The BlockMask of rows[r] = (0, starts ..., T) (Documents.rows), from the bounds on the host (module doc)."""
    from torch.nn.attention.flex_attention import BlockMask

    ids = document_ids(rows)  # (B, T) on the host
    partial, full = blocks(ids, window, size)
    kv_num, kv_index = _ordered(partial)
    full_num, full_index = _ordered(full)
    length = ids.shape[1]
    mask = BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=size,
                                    mask_mod=_rule(ids.to(device, non_blocking=True), window),
                                    seq_lengths=(length, length))
    return mask.to(device)


def document_ids(rows: tuple) -> torch.Tensor:
    """(B, T) int32: each token's document index in its row (0, 1, ...), from the rows' bounds."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(bounds) - 1, dtype=torch.int32),
                                                torch.tensor(bounds).diff()) for bounds in rows])


def blocks(ids: torch.Tensor, window, size: int) -> tuple:
    """(partial, full): (B, 1, blocks, blocks) bool over (query block i, key block j), from the documents of
    each block's first and last token (documents are contiguous and increase along a row)."""
    length = ids.shape[1]
    starts = torch.arange(0, length, size)
    ends = (starts + size).clamp(max=length) - 1  # each block's last token
    first, last = ids[:, starts], ids[:, ends]  # (B, blocks)
    i, j = torch.arange(len(starts))[:, None], torch.arange(len(starts))[None, :]
    reach = (j <= i) & (last[:, None, :] >= first[:, :, None])  # some key of block j in a query's document
    whole = (first == last) & (starts + size <= length)  # (B, blocks): one document, not cut by T
    full = (j < i) & whole[:, :, None] & whole[:, None, :] & (first[:, :, None] == first[:, None, :])
    if window is not None:
        reach &= (starts[:, None] - ends[None, :]) < window  # the nearest pair within the window
        full &= (ends[:, None] - starts[None, :]) < window  # the farthest pair too
    return (reach & ~full)[:, None], full[:, None]


def _ordered(dense: torch.Tensor) -> tuple:
    """flex's (num_blocks (B, 1, blocks), indices (B, 1, blocks, blocks)) int32 of a dense block mask: each
    query block's key blocks first, ascending (as torch's create_block_mask orders them)."""
    dense = dense.to(torch.int32)
    return (dense.sum(-1, dtype=torch.int32),
            torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))


def _rule(ids: torch.Tensor, window):
    """The mask_mod: key kv seen by query q of row b where both lie in one document, kv <= q, and (with a
    window) q - kv < window, as HF's sliding_window_causal_mask_function."""
    if window is None:
        def rule(b, h, q, kv):
            return (ids[b, q] == ids[b, kv]) & (q >= kv)
    else:
        def rule(b, h, q, kv):
            return (ids[b, q] == ids[b, kv]) & (q >= kv) & (q - kv < window)
    return rule
