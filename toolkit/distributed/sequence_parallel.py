"""Ulysses sequence parallelism (sp > 1) through DeepSpeed's own pieces (deepspeed.runtime.sequence_parallel.
ulysses_sp, 0.19.8), at pp = 1 and inside pipeline stages.

Each group of sp consecutive ranks (DeepSpeed's parallel_state_sp) reads the same rows and keeps its
1/sp slice of the sequence: input ids, positions and the labels shifted BEFORE slicing (the next token of
a slice's last position lives on the next rank), as UlyssesSPDataLoaderAdapter does. Every rank has the
whole rows, so slicing needs no collective (the adapter gathers rows because each of its ranks read others).

Attention: UlyssesSPAttentionHF all-to-alls q, k, v to the full sequence for heads / sp heads, gathers the
position ids, and calls the core attention with NO mask (it drops HF's, built for the local slice). So HF
builds none: `register` makes its mask builder for the implementation return None, and each rank's model
gets an all-ones (B, T / sp) padding mask, with which HF does not look for packed documents in the slice's
positions either (a device-to-host read). Otherwise a slice holding a document start makes HF build a
(B, 1, T / sp, T / sp) bool mask for nothing: 4 GiB a row at T 131072, sp 2.
Under sdpa Ulysses' call is plain causal attention: packed documents would see each other.
`document_sdpa` is the core attention dstk hands it instead: causal AND inside each document, one causal
sdpa call per document, with no (T x T) mask (that would be 16 GiB a row at 131072 tokens). The documents
(models.attention.Documents: the whole rows' bounds, on the host) are computed once per micro-batch where
the rows are whole (`shard`, on the host at pp = 1; a stage's first block at pp > 1) and reach every layer's
core as the `documents` keyword, so no layer reads a device value. A sliding-window layer (mistral, gemma)
runs a document longer than its window as its first `window` tokens (plain causal) and then blocks of
step = min(window, BLOCK) queries, each over its window of keys with a corner of one (step, step + window)
band mask shared by all blocks and layers: exact, memory linear in T, where a (B, 1, T, T) mask would be
2 GiB a layer at T 32768 once sdpa made it additive.
flash_attention_2 gets the documents as its variable-length arguments (cu_seq_lens, max_length of the whole
rows, from the same Documents, once per micro-batch: `document_flash`), so HF reads no position in a layer;
mbs 1 is still required (check_attention).

Loss: each rank's loss is its slice's summed token losses / the micro-batch's targets (num_items_in_batch),
so the sp group's losses sum to the micro-batch's mean, the one-process value, and its gradients sum to
the one-process gradient (DeepSpeed sums gradients over all ranks and divides by dp = world / sp). HF
Trainer's deepspeed_sp_compute_loss gets the same value by a differentiable all_gather of each rank's
mean weighted by its targets; backward through that gathers sp copies of the gradient.

Inside pipeline stages (pp > 1), which DeepSpeed does not offer (its PipelineModule path takes no mpu):
- The grid: DeepSpeed's pipeline engine is given pp x (dp * sp) ranks (PipeDataParallelTopology), the sp
  ranks of a group as data-parallel ones of their stage. Ranks are ordered stage, dp, sp (Topology), so the
  sp groups DeepSpeed's parallel_state_sp builds (runs of sp consecutive ranks) lie inside a stage, and each
  rank's activations go to the rank of the next stage with the same dp and sp coordinates: they stay
  sequence-sharded, 1/sp of the hidden state per send. Only the (B, T) document ids travel whole (8 bytes
  a token against 2-4 x hidden / sp).
- The stage layers: the embedding, final norm and head work token by token on the slice; each decoder block
  (models.generic.DecoderBlock, `sequence_shard`) gets its slice's positions, the rows' documents (found by
  the stage's first block: one device-to-host copy per micro-batch) and no mask, and its HF
  attention is Ulysses' (registered process-wide, as at pp = 1) with `document_sdpa` as the core.
- The loss: the engine averages gradients and the reported loss over dp * sp ranks, so each rank's loss
  is sp x its slice's summed token losses / the micro-batch's targets (`PipelineLoss`): the mean over the
  grid is the micro-batch's mean, one process's loss, and the averaged gradient one process's gradient.
"""

from toolkit.errors import ConfigError

CORE = ("sdpa", "flash_attention_2", "flash_attention_3")


def check_attention(attention: str, sp: int, mbs: int) -> None:
    """The attention implementations dstk runs under sp, with their refusal."""
    if sp <= 1:
        return
    if attention not in CORE:
        raise ConfigError(f"--attention {attention} with sp {sp}: Ulysses needs attention without a (seq x seq) "
                          "mask built by HF (DeepSpeed refuses eager); use --attention sdpa (CPU, or any GPU) or "
                          "flash_attention_2")
    if attention.startswith("flash") and mbs > 1:
        raise ConfigError(f"--attention {attention} with sp {sp} and mbs {mbs}: flash attention finds packed documents "
                          "from position ids only at batch size 1, so documents would see each other; use mbs 1 "
                          "(raise gas to keep the global batch), or --attention sdpa")


def document_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention over the full sequence Ulysses hands it (query (B, heads/sp, T, hs)), causal and
    inside each document of kwargs["documents"] (models.attention.Documents of the whole rows; without it,
    read from the gathered kwargs["position_ids"] (B, T): one device-to-host copy per layer), without a
    (T x T) mask: one causal call per document (torch's flash / memory-efficient kernels: memory linear in
    T), all rows in one call where they share their documents. A sliding window shorter than a document
    (kwargs["sliding_window"], mistral, qwen2, gemma): `_windowed`. Returns (B, T, heads/sp, hs), None.
    On CUDA (`_use_flex`) one flex_attention call over all rows with the micro-batch's document BlockMask
    (document_flex), where it computes what sdpa does (no dropout, causal: `document_flex.supported`); the loop
    is the CPU path and the fallback."""
    import torch

    from models.attention import document_bounds
    from toolkit.distributed import document_flex

    documents = kwargs.get("documents")
    if documents is None:
        documents = document_bounds(kwargs["position_ids"])
    if documents.rows[0][-1] != query.shape[2]:
        raise ValueError(f"documents of {documents.rows[0][-1]} tokens for attention over {query.shape[2]}")
    if _use_flex(query) and document_flex.supported(module, kwargs):
        return document_flex.attention(query, key, value, documents, kwargs.get("sliding_window"),
                                       kwargs.get("scaling")), None
    out = []
    for rows, bounds in documents.groups():
        pieces = [piece for a, b in zip(bounds, bounds[1:])
                  for piece in _document(module, query[rows], key[rows], value[rows], a, b, documents, kwargs)]
        out.append(torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0])  # (rows, T, heads, hs)
    return (torch.cat(out) if len(out) > 1 else out[0]), None


def _use_flex(query) -> bool:
    """The flex path (document_flex) on CUDA where torch has flex_attention. On CPU the per-document sdpa loop:
    torch 2.13 has no flex_attention backward on CPU (NotImplementedError), and its forward there is either
    eager (the whole (T x T) scores) or compiled by inductor's C++ backend (half a minute per graph)."""
    from toolkit.distributed import document_flex

    return query.is_cuda and document_flex.available()


BLOCK = 1024  # queries per call in a sliding-window document longer than its window


def _document(module, query, key, value, a: int, b: int, documents, kwargs) -> list:
    """The attention output of document [a, b) of these rows, in pieces (rows, tokens, heads, hs): one causal
    call where the sliding window (if any) covers the document."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = kwargs.get("sliding_window")
    if window is None or b - a <= window:
        return [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]]
    return _windowed(module, query, key, value, a, b, window, documents, kwargs)


def _windowed(module, query, key, value, a: int, b: int, window: int, documents, kwargs) -> list:
    """Document [a, b), longer than the window: its first `window` tokens in one causal call (the window does
    not bite there), then query blocks [s, e) of `step` tokens, each over keys [s - window, e) with the band
    mask's top-left (e - s, e - s + window) corner (_band). The document's keys and values are repeated to the
    query heads once (as HF's sdpa does when it gets a mask)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    step, groups, head = min(window, BLOCK), query.shape[1] // key.shape[1], a + window
    band = _band(documents, step, window, query.dtype, query.device)
    pieces = [sdpa_attention_forward(module, query[:, :, a:head], key[:, :, a:head], value[:, :, a:head], None,
                                     **kwargs)[0]]
    key, value = repeat_kv(key[:, :, a:b], groups), repeat_kv(value[:, :, a:b], groups)  # (rows, heads, b - a, hs)
    for s in range(head, b, step):
        e = min(s + step, b)
        keys = slice(s - window - a, e - a)
        out = F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, keys], value[:, :, keys],
                                             attn_mask=band[None, None, :e - s, :e - s + window],
                                             dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
        pieces.append(out.transpose(1, 2))  # (rows, e - s, heads, hs), as sdpa_attention_forward returns
    return pieces


def _band(documents, step: int, window: int, dtype, device):
    """The additive mask of a query block [s, s + step) over keys [s - window, s + step): query i sees key j
    where 0 <= (s + i) - (s - window + j) < window, i.e. i < j <= i + window. (step, step + window) rounded up
    to 16 columns, so that its corners are views sdpa's memory-efficient kernel takes as they are (rows 16-
    aligned). One per micro-batch, dtype and device (kept in the Documents), shared by every block and layer."""
    import torch

    from models.attention import additive

    made = ("band", step, window, dtype, device)
    if made not in documents.cache:
        i = torch.arange(step, device=device)[:, None]
        j = torch.arange(-(-(step + window) // 16) * 16, device=device)[None, :]
        documents.cache[made] = additive((i < j) & (j <= i + window), dtype)
    return documents.cache[made]


def register(config, sp: int, mbs: int):
    """Ulysses for a model of HF `config` (its attention implementation) over groups of sp consecutive
    ranks; returns DeepSpeed's parallel_state_sp, its groups (at pp = 1 deepspeed.initialize's mpu, as
    UlyssesGroups). Process-wide: it replaces the implementation in transformers' ALL_ATTENTION_FUNCTIONS (each
    rank is its own process)."""
    from types import SimpleNamespace

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    attention = config._attn_implementation
    attention_for_ulysses(attention)
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=SimpleNamespace(config=config), core_attn_implementation=attention,
        sequence_parallel_size=sp, micro_batch_size=mbs, seq_length_is_variable=True)


def attention_for_ulysses(attention: str) -> None:
    """What transformers calls under Ulysses in this process (before Ulysses wraps the attention): under sdpa,
    `document_sdpa` as the core; under flash, HF's flash with the documents' variable-length arguments
    (`document_flash`); for any implementation no mask builder (module doc)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if attention == "sdpa":
        ALL_ATTENTION_FUNCTIONS["sdpa"] = document_sdpa  # the core Ulysses calls after its all-to-all
    elif attention.startswith("flash"):
        core = ALL_ATTENTION_FUNCTIONS[attention]
        ALL_ATTENTION_FUNCTIONS[attention] = document_flash(getattr(core, "core", core))
    ALL_MASK_ATTENTION_FUNCTIONS[attention] = no_mask


def document_flash(core):
    """HF's flash attention `core` over the full sequence Ulysses hands it, given the variable-length arguments
    of kwargs["documents"] (models.attention.document_varlen: built once per micro-batch): without them
    transformers reads the gathered position ids in every layer to find packed documents (a host sync each)."""
    def attention(module, query, key, value, attention_mask, documents=None, **kwargs):
        from models.attention import document_varlen

        if documents is not None and kwargs.get("cu_seq_lens_q") is None:
            kwargs.update(document_varlen(documents, query.device))
        return core(module, query, key, value, attention_mask, **kwargs)
    attention.core = core
    return attention


def no_mask(*args, **kwargs) -> None:
    """HF's mask builder under Ulysses: no mask, which Ulysses' attention would drop."""
    return None


class UlyssesGroups:
    """The mpu deepspeed.initialize gets at pp = 1 under sp: DeepSpeed's parallel_state_sp (its sequence and
    sequence-data-parallel groups, which the engine and ZeRO read; ZeRO 1-3 and DeepSpeed's groups know it by
    its `initialize_sequence_parallel` and then see no model parallelism: stage_1_and_2.py:309, stage3.py:371,
    utils/groups.py), except that every rank is model-parallel rank 0 of a group of one.

    parallel_state_sp names the sp rank the model-parallel rank, so DeepSpeed's norm code (BF16_Optimizer's
    get_grads_for_norm, clip_grad_norm_, get_weight_norm, CheckOverflow) counts a gradient on sp rank 0 only and
    sums over the sp group; BF16_Optimizer (bf16 with fp32 accumulation at ZeRO 1, `dstk generate-config --sp 2
    --bf16`) then stacks an empty list on sp rank 1 and stops at step 1 (deepspeed 0.19.8 runtime/utils.py:952).
    Each rank holds the whole gradient, all-reduced over the dp x sp ranks (ZeRO 0 and BF16_Optimizer: every
    rank the full buffer), so each rank's own norm is the norm, with nothing to add over a group."""

    def __init__(self, sp_state):
        import torch.distributed as dist

        self._sp = sp_state
        rank = dist.get_rank()
        for r in range(dist.get_world_size()):  # new_group is called by every rank for every group, in order
            group = dist.new_group([r])
            if r == rank:
                self._alone = group

    def __getattr__(self, name):  # the sequence(-data)-parallel groups, ranks and sizes, and its marker
        if name.startswith("_"):  # not set yet (a copy): no recursion through self._sp
            raise AttributeError(name)
        return getattr(self._sp, name)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return self._alone


def shard_stage(module, kinds: list, sp: int, sp_rank: int) -> None:
    """A pipeline stage (models.build_pipeline_module's PipelineModule; kinds: the spec's, per layer) made to run
    on this rank's 1/sp of the sequence: each decoder block told its slice (`sequence_shard`). Refused: blocks
    of a wrapper without that support (GPT-2's learned positions), MoE blocks whose aux loss sums routers."""
    for index, layer in enumerate(module.forward_funcs, start=module._local_start):
        if kinds[index] != "block":
            continue  # the embedding, final norm and head work token by token
        if not hasattr(layer, "sequence_shard"):
            raise ConfigError(f"sp {sp} with pipeline stages: {type(layer).__name__} layers do not run on a slice of "
                              f"the sequence yet; use pp 1 with sp {sp}, or sp 1")
        if getattr(layer, "routers", None) is not None:
            raise ConfigError(f"sp {sp} with pipeline stages: the MoE router aux loss (output_router_logits) is summed "
                              "over a stage's whole rows, not yet over a slice; set output_router_logits false in the "
                              f"model's config, or use pp 1 with sp {sp}")
        layer.sequence_shard = (sp, sp_rank)


def backward_scale(cfg: dict, sp: int) -> int:
    """What a rank's loss is multiplied by for backward so DeepSpeed's gradient is one process's. ZeRO 0-2
    divide the gradient summed over all ranks by world / sp (engine.py _reduce_non_expert_gradients,
    stage_1_and_2.py); ZeRO-3's reduce-scatter (stage3.py __avg_scatter_grads, "reduce_scatter": true, its
    default) divides by the whole world (coalesced_collectives.reduce_scatter_coalesced), sp times too much:
    measured, grad norms half one process's at sp 2. "reduce_scatter": false with sp is refused (rules)."""
    zero = cfg.get("zero_optimization") or {}
    return sp if sp > 1 and zero.get("stage", 0) == 3 else 1


def _slices(batch, sp: int, sp_rank: int) -> tuple:
    """(input ids, shifted labels, the slice, the micro-batch's targets) of a micro-batch of whole rows."""
    import torch.nn.functional as F

    from toolkit.data.formats import IGNORE_INDEX

    (input_ids, _), labels = batch
    length = input_ids.shape[1]
    if length % sp:
        raise ConfigError(f"a micro-batch of {length} tokens per row is not divisible by sp {sp}; use a --seq-len "
                          "that sp divides")
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    part = slice(length // sp * sp_rank, length // sp * (sp_rank + 1))
    return input_ids, shift, part, int((shift != IGNORE_INDEX).sum())


def shard(batch, sp: int, sp_rank: int) -> dict:
    """A micro-batch ((input_ids, doc_ids), labels) of whole (B, T) rows, on the host -> this rank's keyword
    arguments for the HF model: its T / sp slice of input_ids, position_ids and shift_labels (labels shifted
    left over the whole row), num_items_in_batch (the targets of the whole micro-batch), an all-ones padding
    mask of the slice and the whole rows' documents for the core attention (module doc)."""
    import torch

    from models.attention import document_bounds, positions

    input_ids, shift, part, targets = _slices(batch, sp, sp_rank)
    whole = positions(batch[0][1])  # (B, T), on the host
    mine = shift[:, part].contiguous()
    return {"input_ids": input_ids[:, part].contiguous(), "position_ids": whole[:, part].contiguous(),
            "attention_mask": torch.ones(mine.shape, dtype=torch.bool), "documents": document_bounds(whole),
            "labels": mine, "shift_labels": mine, "num_items_in_batch": targets, "use_cache": False}


def stage_batch(batch, sp: int, sp_rank: int) -> tuple:
    """pp > 1: a micro-batch ((input_ids, doc_ids), labels) of whole (B, T) rows -> what the PipelineEngine
    feeds this rank: ((its T / sp slice of input ids, the rows' document ids), (its slice of the labels
    shifted left over the whole row, the micro-batch's targets as a 0-d tensor)) for `PipelineLoss`."""
    import torch

    input_ids, shift, part, targets = _slices(batch, sp, sp_rank)
    return (input_ids[:, part].contiguous(), batch[0][1]), (shift[:, part].contiguous(), torch.tensor(float(targets)))


class PipelineLoss:
    """The last stage's loss under sp (module doc): sp x the slice's summed cross entropy / the micro-batch's
    targets (an all-filler micro-batch: nan, as the mean over no target is at sp 1)."""

    def __init__(self, sp: int):
        self.sp = sp

    def __call__(self, logits, labels):
        import torch.nn.functional as F

        from toolkit.data.formats import IGNORE_INDEX

        shift, targets = labels
        logits = logits.float()  # a no-op in fp32
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), shift.reshape(-1).to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return total * self.sp / targets.to(total.device)
