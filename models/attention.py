"""What a pipeline stage's decoder layers need besides the hidden state, built once per micro-batch.

Between stages travel only the hidden state and the document ids (B, T): 0 padding, 1..k the k-th
document packed in a row (a 0/1 padding mask is the one-document case). From them each stage builds,
for its first block and reused by the others (cached on the document-id tensor itself), what the HF model
builds at pp = 1 from the inputs dstk gives it (models.spec.attention_inputs, decided per micro-batch): for
a micro-batch of one document per row, each row's padding mask and positions 0 .. T-1; for one holding a
packed row, HF's packed-sequence format in every row (positions restart at each document, padding a
segment of its own). The padding tokens then compute what they compute at pp = 1 too, which the MoE router
aux loss sees (it counts them in a packed micro-batch, as HF does: models/moe.py):
  - position ids (B, T) (learned and rotary positions count from each document's start);
  - the attention mask for each layer kind (causal, sliding-window, chunked), by HF's own mask builders
    with the rows' rule added (so eager, sdpa and flex masks agree with HF's), never crossing a document
    or padding boundary (sdpa and eager: HF's mask functions over broadcast indices, the builders' mask
    without their torch.vmap). With sdpa the mask is handed over additive, in the activations' dtype: torch
    turns a bool mask into that at every call, a (B, 1, T, T) copy per layer that the memory-efficient
    kernel keeps for backward; given once, every layer refers to the same tensor. flash_attention_2 gets
    no mask but the variable-length arguments (cu_seq_lens_q/k, max_length_q/k) over the micro-batch's
    flattened documents, which is how transformers' flash path keeps documents apart at any batch size
    (from position_ids it finds packing only at batch size 1).
No host synchronisation: nothing here reads a value of the device tensors, except flash's variable
lengths and, under Ulysses, the documents' bounds (their count is the data's), each one device-to-host
copy of the document starts per micro-batch and stage.

At pp = 1 the HF model's forward builds its own masks, one per layer kind and micro-batch, shared by its
layers: `share_additive_masks` has them built additive under sdpa (torch would otherwise convert the bool
mask at every layer, a (B, 1, T, T) copy each kept for backward).
"""

import weakref

import torch
import torch.nn.functional as F

from models.spec import document_positions

FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
_KEY = "_dstk_stage_inputs"  # attribute of the document-id tensor: {what: value}


def _memo(doc_ids: torch.Tensor, what, build):
    """`build()` once per document-id tensor (one micro-batch on one stage: every block of the stage
    gets the same tensor object; recomputation under activation checkpointing gets a new one)."""
    memo = getattr(doc_ids, _KEY, None)
    if memo is None or memo[0]() is not doc_ids:
        memo = (weakref.ref(doc_ids), {})
        setattr(doc_ids, _KEY, memo)
    if what not in memo[1]:
        memo[1][what] = build()
    return memo[1][what]


def _single(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: whether the rows are read as one document each (padded or not), i.e. no row of the micro-batch
    is packed: HF at pp = 1 gets a padding mask then, else the packed format for every row."""
    return _memo(doc_ids, "single", lambda: (doc_ids.amax() <= 1).expand(doc_ids.shape[0]))


def positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions: 0 .. T-1 in a micro-batch of one-document rows (HF's default), else restarting at each
    document (and padding run) of every row; once per micro-batch."""
    def build():
        counting = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
        return torch.where(_single(doc_ids)[:, None], counting, document_positions(doc_ids))
    return _memo(doc_ids, "positions", build)


def slice_inputs(doc_ids: torch.Tensor, length: int, rank: int) -> dict:
    """A decoder block's keyword arguments under Ulysses (sequence parallelism: each rank's hidden state holds
    `length` tokens of the whole rows' T): the (B, length) positions of slice `rank`, and the whole rows'
    `Documents` for the core attention (one device-to-host copy); once per micro-batch."""
    return {"position_ids": _memo(doc_ids, ("slice", length, rank),
                                  lambda: positions(doc_ids)[:, rank * length:(rank + 1) * length].contiguous()),
            "documents": _memo(doc_ids, "documents", lambda: document_bounds(positions(doc_ids)))}


class Documents:
    """Where the documents of a micro-batch's whole (B, T) rows lie, on the host, for attention that takes each
    document alone (toolkit.distributed.sequence_parallel.document_sdpa): rows[r] = (0, starts ..., T). Built
    once per micro-batch and handed to every layer, whose device tensors it keeps in `cache` (the sliding
    window's band mask), so no layer reads a device value."""

    def __init__(self, rows: tuple):
        self.rows = rows
        self.cache = {}

    def groups(self) -> list:
        """[(rows, bounds)]: every row at once where all share their bounds (one-document rows), else each."""
        if all(bounds == self.rows[0] for bounds in self.rows):
            return [(slice(None), self.rows[0])]
        return [(slice(row, row + 1), bounds) for row, bounds in enumerate(self.rows)]


def document_varlen(documents: Documents, device) -> dict:
    """flash_attention_2's variable-length arguments (as varlen_arguments) for the rows of `documents`, flattened
    into one sequence: cu_seq_lens int32 on `device` (documents + 1 offsets), max_length a host int. From the
    host bounds, once per micro-batch and device (kept in the Documents): transformers' flash path otherwise reads
    the position ids in every layer to look for packed documents (a device-to-host sync each)."""
    made = ("varlen", str(device))
    if made not in documents.cache:
        length = documents.rows[0][-1]
        offsets = [row * length + start for row, bounds in enumerate(documents.rows) for start in bounds[:-1]]
        cu = torch.tensor(offsets + [len(documents.rows) * length], dtype=torch.int32)
        longest = max(b - a for bounds in documents.rows for a, b in zip(bounds, bounds[1:]))
        documents.cache[made] = {"cu_seq_lens_q": cu.to(device), "cu_seq_lens_k": cu.to(device),
                                 "max_length_q": longest, "max_length_k": longest}
    return documents.cache[made]


def document_bounds(position_ids: torch.Tensor) -> Documents:
    """The documents of (B, T) position ids: one starts where a position does not follow its predecessor's.
    A device tensor costs one device-to-host copy of the (B, T - 1) starts."""
    rows, length = position_ids.shape
    starts = (position_ids[:, 1:] != position_ids[:, :-1] + 1).cpu().nonzero().tolist()  # [(row, t - 1)]
    bounds = [[0] for _ in range(rows)]
    for row, before in starts:
        bounds[row].append(before + 1)
    return Documents(tuple(tuple(cuts + [length]) for cuts in bounds))


def _rows_rule(doc_ids: torch.Tensor):
    """HF's mask_function form of the rows' rule, added to the layer kind's causal rule: in a micro-batch of
    one-document rows a token attends to its row's tokens, not its padding (HF's padding mask); in one with a
    packed row, every token stays inside its document (padding: its own run)."""
    single = _single(doc_ids)

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return torch.where(single[batch_idx], doc_ids[batch_idx, kv_idx] > 0,
                           doc_ids[batch_idx, q_idx] == doc_ids[batch_idx, kv_idx])
    return inner


def layer_inputs(doc_ids: torch.Tensor, hidden: torch.Tensor, config, mask_fn) -> dict:
    """attention_mask and position_ids (and flash's variable-length arguments) for one decoder layer of
    kind `mask_fn` (HF's create_causal_mask, create_sliding_window_causal_mask, ...)."""
    impl = config._attn_implementation
    out = {"position_ids": positions(doc_ids)}
    if impl in FLASH:
        out.update(_memo(doc_ids, "varlen", lambda: varlen_arguments(doc_ids)))
    out["attention_mask"] = _memo(doc_ids, (mask_fn, impl, hidden.dtype),
                                  lambda: document_mask(doc_ids, hidden, config, mask_fn))
    return out


def document_mask(doc_ids: torch.Tensor, hidden: torch.Tensor, config, mask_fn):
    """HF's mask of kind `mask_fn` for these rows with attention kept inside each document (None where
    the implementation takes no mask, e.g. flash without padding). sdpa: additive, in hidden's dtype.

    For sdpa and eager, HF's own mask function of the layer kind and the rows' rule are evaluated by HF's
    mask interface (sdpa_mask, eager_mask) over broadcast indices: the rows' rule is index-based, so this
    is the mask hf_document_mask builds, without the four nested torch.vmap HF uses for any custom rule
    (~7 ms of host time per micro-batch and stage, more than the tiny models' whole forward)."""
    from transformers import masking_utils as mu

    impl, rule = config._attn_implementation, _kind_rule(mask_fn, config, doc_ids)
    if impl not in ("sdpa", "eager") or rule is None or not getattr(config, "is_causal", True):
        return hf_document_mask(doc_ids, hidden, config, mask_fn)
    rows, length = doc_ids.shape
    mask = mu.ALL_MASK_ATTENTION_FUNCTIONS[impl](
        batch_size=rows, q_length=length, kv_length=length, mask_function=mu.and_masks(rule, _rows_rule(doc_ids)),
        allow_is_causal_skip=False, dtype=hidden.dtype, config=config, use_vmap=False, device=hidden.device)
    return _additive(mask, hidden, config)


def _kind_rule(mask_fn, config, doc_ids: torch.Tensor):
    """The mask function HF's builder `mask_fn` starts from (before the rows' rule), or None for a builder
    not known here."""
    from transformers import masking_utils as mu

    if mask_fn is mu.create_causal_mask:
        return mu.causal_mask_function
    if mask_fn is mu.create_sliding_window_causal_mask and getattr(config, "sliding_window", None) is not None:
        return mu.sliding_window_causal_mask_function(config.sliding_window)
    if mask_fn is mu.create_chunked_causal_mask and getattr(config, "attention_chunk_size", None) is not None:
        no_left_padding = torch.zeros(doc_ids.shape[0], device=doc_ids.device, dtype=torch.long)
        return mu.chunked_causal_mask_function(config.attention_chunk_size, no_left_padding)
    return None


def hf_document_mask(doc_ids: torch.Tensor, hidden: torch.Tensor, config, mask_fn):
    """document_mask through HF's builder `mask_fn` itself, the rows' rule as its and_mask_function (which
    HF evaluates with torch.vmap): flex attention's block mask, flash, builders not known to _kind_rule."""
    # The cache goes by position (4th), no cache: transformers 5.24 renamed the keyword past_key_values -> cache
    # (the old name is deprecated); 5.17 knows only past_key_values. position_ids defaults to None in both.
    mask = mask_fn(config, hidden, None, None, and_mask_function=_rows_rule(doc_ids))
    return _additive(mask, hidden, config)


def _additive(mask, hidden: torch.Tensor, config):
    if config._attn_implementation == "sdpa" and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = additive(mask, hidden.dtype)
    return mask


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as sdpa's additive one in `dtype`: 0 where True, the dtype's lowest where
    False (HF's eager_mask). A mask broadcast over its batch (stride 0) stays broadcast."""
    if mask.dim() == 4 and mask.shape[0] > 1 and mask.stride(0) == 0:
        return additive(mask[:1], dtype).expand(mask.shape)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def share_additive_masks(config) -> None:
    """pp = 1 under sdpa: HF's mask builder for sdpa made to return its mask additive, in the activations' dtype
    (additive_sdpa_mask). The model's forward builds one mask per layer kind and micro-batch and hands it to
    all the layers of that kind; a bool one torch converts at every layer into a (B, 1, T, T) additive copy that
    the memory-efficient kernel keeps for backward (128 MiB a row and layer at T 8192 in bf16: 8 GiB over 64
    layers). Process-wide (each rank is its own process), as Ulysses' attention is; other implementations are
    left as they are."""
    from transformers import masking_utils as mu

    if config._attn_implementation == "sdpa":
        mu.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = additive_sdpa_mask


def additive_sdpa_mask(*args, dtype: torch.dtype | None = None, **kwargs):
    """transformers' sdpa_mask (the packed rows', padding's, window's rule: HF's own), additive in `dtype` (the
    builders pass inputs_embeds' dtype; under torch.autocast, the autocast dtype sdpa computes in). None (the
    causal kernel without a mask) stays None."""
    from transformers import masking_utils as mu

    mask = mu.sdpa_mask(*args, **kwargs)
    if dtype is None or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    device = mask.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    return additive(mask, dtype)


def varlen_arguments(doc_ids: torch.Tensor) -> dict:
    """flash_attention_2's variable-length arguments for a (B, T) micro-batch: the B rows flattened into
    one sequence of documents (padding runs count as documents of their own; a row's end ends one).
    cu_seq_lens: int32 offsets (documents + 1); max_length: the longest, a host int."""
    rows, length = doc_ids.shape
    starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True).reshape(-1)  # (B*T,) row starts too
    offsets = starts.cpu().nonzero().reshape(-1)  # the one device-to-host copy
    cu = torch.cat([offsets, torch.tensor([rows * length])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())  # host tensors: no device sync
    cu = cu.to(doc_ids.device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def model_inputs(doc_ids: torch.Tensor, config) -> dict:
    """pp = 1, where the HF model's own forward builds its masks: attention_mask, position_ids and
    use_cache=False (with a cache HF ignores the packed format) from a batch's document ids while they are
    still on the host (models.spec.attention_inputs); flash with packed rows also gets the variable-length
    arguments (transformers finds packing from position_ids only at batch size 1). Host tensors: the
    caller moves them to the device."""
    from models.spec import attention_inputs

    mask, position_ids = attention_inputs(doc_ids)
    out = {"attention_mask": mask, "position_ids": position_ids, "use_cache": False}
    if mask is None and config._attn_implementation in FLASH:
        out.update(varlen_arguments(doc_ids))
    return out
