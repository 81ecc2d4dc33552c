"""Ulysses sequence parallelism (sp > 1, pp = 1) through DeepSpeed's own pieces
(deepspeed.runtime.sequence_parallel.ulysses_sp, 0.19.8).

Each group of sp consecutive ranks (DeepSpeed's parallel_state_sp) reads the same rows and keeps its
1/sp slice of the sequence: input ids, positions and the labels shifted BEFORE slicing (the next token of
a slice's last position lives on the next rank), as UlyssesSPDataLoaderAdapter does. Every rank has the
whole rows, so slicing needs no collective (the adapter gathers rows because each of its ranks read others).

Attention: UlyssesSPAttentionHF all-to-alls q, k, v to the full sequence for heads / sp heads, gathers the
position ids, and calls the core attention with NO mask (it drops HF's, built for the local slice). Under
sdpa that is plain causal attention: packed documents would see each other. `document_sdpa` is the core
attention dstk hands it instead: causal AND inside each document, the documents read from the gathered
position ids (a document starts where a position does not follow its predecessor), a (B, 1, T, T) bool mask.
flash_attention_2 finds documents from the gathered position ids itself, at batch size 1 only.

Loss: each rank's loss is its slice's summed token losses / the micro-batch's targets (num_items_in_batch),
so the sp group's losses sum to the micro-batch's mean, the one-process value, and its gradients sum to
the one-process gradient (DeepSpeed sums gradients over all ranks and divides by dp = world / sp). HF
Trainer's deepspeed_sp_compute_loss gets the same value by a differentiable all_gather of each rank's
mean weighted by its targets; backward through that gathers sp copies of the gradient.
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


def documents(position_ids: "torch.Tensor") -> "torch.Tensor":
    """(B, T) segment ids: a new segment where a position is not its predecessor's + 1."""
    import torch.nn.functional as F

    starts = F.pad(position_ids[:, 1:] != position_ids[:, :-1] + 1, (1, 0), value=True)
    return starts.long().cumsum(dim=1)


def document_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention over the full sequence Ulysses hands it (query (B, heads/sp, T, hs)), causal
    and inside each document of the gathered kwargs["position_ids"] (B, T)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    docs = documents(kwargs["position_ids"].to(query.device))
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & causal  # (B, 1, T, T)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def register(model, sp: int, mbs: int):
    """Ulysses for `model` (its config's attention implementation) over sp-rank groups; returns the mpu
    deepspeed.initialize takes. Process-wide: it replaces the implementation in transformers'
    ALL_ATTENTION_FUNCTIONS (each rank is its own process)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None) or model.get_base_model().config
    attention = config._attn_implementation
    if attention == "sdpa":
        ALL_ATTENTION_FUNCTIONS["sdpa"] = document_sdpa  # the core Ulysses calls after its all-to-all
    return UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation=attention,
                                                           sequence_parallel_size=sp, micro_batch_size=mbs,
                                                           seq_length_is_variable=True)


def backward_scale(cfg: dict, sp: int) -> int:
    """What a rank's loss is multiplied by for backward so DeepSpeed's gradient is one process's. ZeRO 0-2
    divide the gradient summed over all ranks by world / sp (engine.py _reduce_non_expert_gradients,
    stage_1_and_2.py); ZeRO-3's reduce-scatter (stage3.py __avg_scatter_grads, "reduce_scatter": true, its
    default) divides by the whole world (coalesced_collectives.reduce_scatter_coalesced), sp times too much:
    measured, grad norms half one process's at sp 2. "reduce_scatter": false with sp is refused (rules)."""
    zero = cfg.get("zero_optimization") or {}
    return sp if sp > 1 and zero.get("stage", 0) == 3 else 1


def shard(batch, sp: int, sp_rank: int) -> dict:
    """A micro-batch ((input_ids, doc_ids), labels) of whole (B, T) rows -> this rank's keyword arguments
    for the HF model: its T / sp slice of input_ids, position_ids and shift_labels (labels shifted left
    over the whole row), and num_items_in_batch, the targets of the whole micro-batch."""
    import torch.nn.functional as F

    from models.attention import positions
    from toolkit.data.formats import IGNORE_INDEX

    (input_ids, doc_ids), labels = batch
    length = input_ids.shape[1]
    if length % sp:
        raise ConfigError(f"a micro-batch of {length} tokens per row is not divisible by sp {sp}; use a --seq-len "
                          "that sp divides")
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    part = slice(length // sp * sp_rank, length // sp * (sp_rank + 1))
    mine = shift[:, part].contiguous()
    return {"input_ids": input_ids[:, part].contiguous(), "position_ids": positions(doc_ids)[:, part].contiguous(),
            "labels": mine, "shift_labels": mine, "num_items_in_batch": int((shift != IGNORE_INDEX).sum()),
            "use_cache": False}
