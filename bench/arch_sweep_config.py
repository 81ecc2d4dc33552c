"""Tiny random configs for bench/arch_sweep.py: every size of a model type's default config shrunk.

tiny_config(model_type) rebuilds AutoConfig.for_model(model_type) with the generic rules of SIZES
(applied to every key of that name, in sub-configs and per-layer overrides too), one layer of each
distinct per-layer kind, and PER_TYPE's fixes for what no generic rule reaches.
"""

import json

MAX_PARAMS = 20_000_000  # a "tiny" model above this was not shrunk enough: refuse to build it

# key -> the tiny value (or a function of the default value), applied wherever the key appears.
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
              "num_decoder_layers")  # the first one a config has counts its layers
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
             "encoder_attention_heads", "linear_num_value_heads", "index_n_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads", "multi_query_group_num",
                "linear_num_key_heads")
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "hidden_dim", "embed_dim", "model_dim", "dim",
                     "word_embed_proj_dim", "emb_dim", "lru_width", "hidden_size_global", "adapter_in_dim",
                     "adapter_out_dim", "adapter_input_size", "downsample_hidden_size"), HIDDEN),
    **dict.fromkeys(("n_inner", "d_ff", "ffn_hidden_size", "expert_ffn_hidden_size"), FFN),
    # state-space / recurrent parts: n_heads * d_head == expand * hidden (mamba2, bamba)
    **dict.fromkeys(("mamba_n_heads",), HEADS), **dict.fromkeys(("mamba_d_head",), HEAD_DIM),
    **dict.fromkeys(("expand", "mamba_expand", "n_groups"), lambda v: min(v, 1)),
    **dict.fromkeys(("state_size", "mamba_d_state"), lambda v: min(v, 16)),
    "mamba_d_ssm": HEADS * HEAD_DIM,  # falcon_h1: mamba_n_heads * mamba_d_head
    "hidden_size_per_layer_input": lambda v: min(v, 16), "zero_expert_num": lambda v: min(v, 2),
    **dict.fromkeys(LAYER_KEYS, LAYERS), **dict.fromkeys(HEAD_KEYS, HEADS), **dict.fromkeys(KV_HEAD_KEYS, KV_HEADS),
    **dict.fromkeys(("kv_channels", "attention_head_dim", "head_size", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts"), lambda v: min(v, 4)),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k"),
                    lambda v: min(v, 2)),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "topk_group"), lambda v: min(v, 1)),
    **dict.fromkeys(("n_group", "num_expert_group"), lambda v: min(v, 2)),
    "rotary_dim": HEAD_DIM // 2,  # partial rotary (gptj, codegen): half of each head
    "qk_head_dim": 2 * HEAD_DIM,  # MLA (longcat_flash): qk_nope_head_dim + qk_rope_head_dim
    "kv_lora_rank": 32, "q_lora_rank": 32,
    "vocab_size": 128,
    # seq_len 8: the window really cuts
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "attention_window_size",
                     "local_attention_window_len"), 4),
    "first_k_dense_replace": lambda v: min(v, 1),  # layer 0 dense, layer 1 MoE
    "num_kv_shared_layers": lambda v: min(v, 1),
}

# Defaults that no generic rule reaches, by the model_type of a config or sub-config: sizes that
# must add up, hybrid periods (keep an attention layer in 2-4 layers), flags without which the
# CausalLM class refuses to build, and defaults the HF model itself cannot run. A dict value updates
# the (shrunk) dict of that key, e.g. a sub-config's.
PER_TYPE = {
    # input, recurrent (looped twice), output layer; layer_types without the 'mlp' entries that to_dict writes
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[4, 16]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),  # default: all mamba, and HF's mask code then needs an attention layer
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),  # same
    "blt": dict(use_cache=False),  # BltModel builds DynamicCache(config=BltConfig), which has no num_hidden_layers
    # rope per layer type and none by default; mrope_section is in pairs of frequencies (head_dim 16: 8)
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        "full_attention": None}),
    # DbrxAttention reads rope_theta, which the default lacks, and clamps by clip_qkv (None fails); 8 as dbrx-instruct
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # the sliding layers' head_dim (the config-wide one) == their qk_nope_head_dim (2 * 16: it differs) + qk_rope (16)
    "dots3_note_text": dict(head_dim=3 * HEAD_DIM),
    # layer_types has no default: a short-conv and an attention layer (dense MLPs), then a conv layer with MoE
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),  # the default is all attention when shrunk: keep a conv
    "lfm2_moe": dict(num_hidden_layers=3, num_dense_layers=2, layer_types=["conv", "full_attention", "conv"]),
    # audio-code decoders, the CausalLM of musicgen(_melody): input (batch * num_codebooks, seq): one codebook
    "musicgen_decoder": dict(num_codebooks=1), "musicgen_melody_decoder": dict(num_codebooks=1),
    # the indexed_attention layers build a QSA indexer from these (no defaults): seq 8 in 4 blocks, 2 selected
    "qwen4_exp_text": dict(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=4,
                           indexer_compress_ratio=2, hc_lowrank=16),
    # embedding_dim and num_blocks copy hidden_size and num_hidden_layers when None; the state cache rounds
    # hidden_size * qk_dim_factor (0.5) up to a multiple of 64, the layers do not: hidden 128
    "xlstm": dict(hidden_size=2 * HIDDEN, embedding_dim=None, num_blocks=None),
    # the hybrid layers share one attention block, tied from the first: two of them, or HF's tying finds no
    # target; None and "auto" rederive the attention and dt sizes from hidden_size
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=None, attention_head_dim=None, mamba_dt_rank="auto"),
    "flint": dict(mlp_only_layers=[0]),  # the default [0, 1] leaves 2 layers no MoE block: layer 1 sparse
    "xmod": dict(default_language="en_XX"),  # picks the language adapter; None refuses a batch without lang_ids
    # drafters for speculative decoding: every layer reuses the target model's kv (0: the config sets all)
    "gemma4_unified_assistant": dict(text_config=dict(num_kv_shared_layers=0)),
    "gemma4_assistant": dict(text_config=dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                                              vocab_size_per_layer_input=0)),
}
# Types whose default config does not validate: their PER_TYPE entry builds the default too.
BROKEN_DEFAULTS = {"gemma4_assistant"}
# Types that cannot be built or run tiny here, and why: the sweep puts this before the error it got
# (it still tries them: the note only explains a failure).
CANNOT_RUN = {
    "gemma3n": "its vision tower is a TimmWrapperModel, which needs the timm package (not installed here)",
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"),
                    "a speculative-decoding drafter: its forward needs the target model's inputs_embeds and "
                    "shared_kv_states, not a token batch"),
    "git": "GitForCausalLM's loss always skips the first (image_size / patch_size)^2 + 1 logits (the image "
           "tokens), even without pixel_values: a text batch of 8 leaves none",
    **dict.fromkeys(("musicgen", "musicgen_melody"),
                    "its CausalLM is an audio-code decoder whose labels are (batch, seq, num_codebooks), "
                    "unshifted: a (batch, seq) text batch does not fit"),
}
# None in a default config that the model needs as a number (dots1, ...): experts, top-k, shared.
NONE_DEFAULTS = {"n_routed_experts": 4, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
                 "n_shared_experts": 1, "head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}


def _tiny_value(key, value):
    """The tiny value for `key`, or None to leave it."""
    if value is None:
        return NONE_DEFAULTS.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    rule = SIZES.get(key)
    if rule is None and ("intermediate_size" in key or "ffn_dim" in key):
        rule = FFN
    elif rule is None and "vocab" in key:  # vocab_size_per_layer_input (gemma3n/4), hash vocabularies (blt)
        rule = SIZES["vocab_size"]
    elif rule is None and key.endswith("head_dim"):
        rule = HEAD_DIM
    if rule is None:
        return None
    return rule(value) if callable(rule) else rule


def _shrink(values: dict, fill_none: bool = True) -> dict:
    """Tiny values for the sizes in one flat dict of settings (a config's, or one layer's overrides)."""
    out = {k: t for k, v in values.items() if (v is not None or fill_none) and (t := _tiny_value(k, v)) is not None}
    heads = next((k for k in HEAD_KEYS if isinstance(values.get(k), int)), None)
    for key in (k for k in KV_HEAD_KEYS if k in out):
        if heads and values[key] == values[heads]:  # MHA (and MLA, which has no grouped kv) stays so
            out[key] = out[heads]
    return out


def _layer_indices(n_layers: int, values: dict) -> tuple:
    """Which of the default config's layers the tiny one keeps: the first layer of each distinct
    combination of per-layer settings (so every layer kind is exercised), padded to >= LAYERS;
    and the per-layer settings {key: list or index-keyed dict}."""
    lists = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == n_layers and n_layers > 1}
    lists |= {k: v for k, v in values.items() if isinstance(v, dict) and v and _by_layer(v, n_layers)}
    keep, seen = [], set()
    for i in range(n_layers):
        kind = tuple(json.dumps(_at(v, i), sort_keys=True, default=str) for v in lists.values())
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    keep += [i for i in range(n_layers) if i not in keep][:max(0, LAYERS - len(keep))]
    return sorted(keep)[:max(LAYERS, 4)], lists


def _by_layer(mapping: dict, n_layers: int) -> bool:
    """A dict keyed by layer index (per_layer_config: {5: {...}, "11": {...}, "02": {...}})."""
    return all(str(k).isdigit() and int(k) < n_layers and isinstance(v, dict) for k, v in mapping.items())


def _at(per_layer, i):
    """Layer i's entry of a per-layer list or index-keyed dict (None where a dict has none)."""
    if isinstance(per_layer, list):
        return per_layer[i]
    return next((v for k, v in per_layer.items() if int(k) == i), None)


def _select(per_layer, keep: list, defaults: dict):
    """The entries of the kept layers, renumbered 0..len(keep)-1; string keys keep their zero-padding
    ("02"). A dict entry (one layer's overrides) is shrunk too, a fixed size that differs from the
    config-wide `defaults` to twice the tiny one: the layers stay heterogeneous (gemma4 head_dim)."""
    def tiny(entry):
        if not isinstance(entry, dict):
            return entry
        small = _shrink(entry, fill_none=False)
        twice = {k for k in small if not callable(SIZES.get(k)) and entry[k] != defaults.get(k)}
        return {**entry, **small, **{k: 2 * small[k] for k in twice}}

    if isinstance(per_layer, list):
        return [tiny(per_layer[i]) for i in keep]
    first = next(iter(per_layer))
    key = (lambda n: f"{n:0{len(first)}d}") if isinstance(first, str) else type(first)
    return {key(new): tiny(_at(per_layer, old)) for new, old in enumerate(keep) if _at(per_layer, old) is not None}


def _overrides(config) -> dict:
    """Keyword arguments that rebuild `config` tiny (derived fields are recomputed by the config)."""
    values = config.to_dict()  # raw values: per-layer (heterogeneous) configs refuse getattr
    out = _shrink(values)
    layer_key = next((k for k in LAYER_KEYS if isinstance(values.get(k), int)), None)
    if layer_key:
        keep, lists = _layer_indices(values[layer_key], values)
        out[layer_key] = len(keep)
        out.update({k: _select(v, keep, values) for k, v in lists.items()})
    vocab = out.get("vocab_size", values.get("vocab_size"))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values.get(key), int) and vocab and values[key] >= vocab:
            out[key] = min(vocab - 1, 2)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if hasattr(sub, "to_dict"):
            out[name] = {**sub.to_dict(), **_overrides(sub)}  # all of it: parents copy fields from it
    for key, value in PER_TYPE.get(getattr(config, "model_type", ""), {}).items():
        both = isinstance(value, dict) and isinstance(out.get(key, values.get(key)), dict)
        out[key] = {**out.get(key, values.get(key)), **value} if both else value
    return out


def tiny_config(model_type: str):
    """The default config of `model_type` rebuilt with every known size shrunk, dropout off, eager."""
    from transformers import AutoConfig

    from toolkit.train.hf import no_dropout

    default = AutoConfig.for_model(model_type, **(PER_TYPE[model_type] if model_type in BROKEN_DEFAULTS else {}))
    overrides = _overrides(default)
    if overrides.get("is_decoder", default.to_dict().get("is_decoder")) is False and not default.is_encoder_decoder:
        overrides["is_decoder"] = True  # BERT-style CausalLMs attend causally only as decoders (HF warns)
    config = AutoConfig.for_model(model_type, **overrides)
    for name in getattr(config, "sub_configs", {}) or {}:
        if hasattr(getattr(config, name, None), "to_dict"):
            no_dropout(getattr(config, name))
    return no_dropout(config)


def causal_lm_class(config):
    """(the CausalLM class registered for `config`'s type, the config it takes): a composite config's
    sub-config where the class is declared for that (MusicgenForCausalLM takes the decoder's config)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[type(config)]
    wanted = getattr(cls, "config_class", None) or type(config)
    if isinstance(config, wanted):
        return cls, config
    subs = [getattr(config, n) for n in config.sub_configs if isinstance(getattr(config, n, None), wanted)]
    return cls, (subs[0] if subs else config)


def build_tiny(model_type: str, seed: int = 0):
    """The tiny HF causal LM of `model_type`: fp32, eager attention, dropout off, eval mode."""
    import torch

    from models.weights.loading import random_model

    cls, config = causal_lm_class(tiny_config(model_type))
    with torch.device("meta"):
        params = sum(p.numel() for p in cls._from_config(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"tiny config still has {params / 1e6:.1f}M parameters (> {MAX_PARAMS / 1e6:.0f}M): "
                         "some size is not shrunk")
    model = random_model(config, seed=seed, cls=cls, attn_implementation="eager", dtype=torch.float32)
    return model.float().eval()
