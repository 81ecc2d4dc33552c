"""Any causal LM whose config declares `base_model_pp_plan` (llama, mistral, qwen2/3, gemma, phi3,
olmo, gpt_neox, ...) as [embedding, L decoder layers, final norm, LM head]: L + 3 layers.

What travels between stages: (hidden (B, T, H) float, document ids (B, T) int64: 0 padding, 1..k the
documents packed in a row; a plain 0/1 padding mask is the one-document case). The first block of a
stage builds the micro-batch's positions and, per layer kind, its mask with HF's own mask function
(models.attention: once per micro-batch and stage, no host sync; flash gets variable-length arguments);
each block recomputes rotary cos/sin from the model's rotary module at each document's positions.
Nothing but those two fixed-shape tensors is sent. The decoder layers are HF's own modules.
"""

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import FLASH, layer_inputs, slice_inputs
from models.moe import RouterAux, RouterCapture
from models.spec import PipelineSpec, causal_lm_loss, needs_grad
from toolkit.errors import ConfigError

# config attributes that change the base model's forward outside its sub-modules: not replicated.
_UNSUPPORTED = ("embedding_multiplier", "scale_emb", "mup_embedding_multiplier")


class EmbedStage(nn.Module):
    """Layer 0: (input_ids, document ids) -> (hidden (B, T, H), document ids[, router sums (2E + 1)])."""

    def __init__(self, source, names, aux=None):
        super().__init__()
        self.parts = nn.ModuleList(source.module(n) for n in names)  # embed_tokens[, emb_dropout]
        self.aux = aux  # models.moe.RouterAux: the MoE aux loss's sums start here

    def forward(self, inputs):
        x, doc_ids = inputs[0], inputs[1]
        for part in self.parts:
            x = part(x)
        return (needs_grad(x), doc_ids) + ((self.aux.zeros(x),) if self.aux else ())


class DecoderBlock(nn.Module):
    """One HF decoder layer: (hidden, mask2d) -> (hidden, mask2d), mask and rotary built here."""

    def __init__(self, source, layer_name, rotary_name, config, layer_idx, aux=None):
        super().__init__()
        self.layer = source.module(layer_name)
        self.routers = RouterCapture(self.layer, aux) if aux else None  # MoE aux loss: add this layer's sums
        self.rotary = source.module(rotary_name) if rotary_name else None
        self.config = config = config.get_text_config()  # a multimodal model's decoder: its text config
        self.mask_fn = _mask_function(config, layer_idx)
        self.sequence_shard = None  # (sp, sp rank) under Ulysses: the hidden state is that slice of the rows
        self.rope_kwargs = _rope_kwargs(self.rotary, config, layer_idx)
        params = inspect.signature(self.layer.forward).parameters.values()
        # a layer without **kwargs gets only what it names (older layers take no position_embeddings)
        self.takes = None if any(p.kind is p.VAR_KEYWORD for p in params) else {p.name for p in params}
        if self.takes is not None and config._attn_implementation in FLASH:
            raise ConfigError(f"model_type {config.model_type!r}: {type(self.layer).__name__}.forward takes no **kwargs, "
                              f"so {config._attn_implementation} cannot get the variable-length arguments that keep "
                              "packed documents apart; use --attention sdpa")

    def forward(self, inputs):
        hidden, doc_ids, *stats = inputs
        if self.sequence_shard is None:
            kwargs = layer_inputs(doc_ids, hidden, self.config, self.mask_fn)  # attention_mask, position_ids[, varlen]
        else:  # the slice's positions, no mask: Ulysses' core attention keeps the documents apart
            kwargs = slice_inputs(doc_ids, hidden.shape[1], self.sequence_shard[1])  # position_ids, documents
        rope = self.rotary(hidden, kwargs["position_ids"], **self.rope_kwargs) if self.rotary is not None else None
        kwargs["position_embeddings"] = rope
        if self.takes is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.takes}
        if self.routers is None:
            out = self.layer(hidden, **kwargs)
        else:
            out, stats[0] = self.routers.add(stats[0], doc_ids, lambda: self.layer(hidden, **kwargs))
        return ((out[0] if isinstance(out, tuple) else out), doc_ids, *stats)


class FinalNorm(nn.Module):
    """Layer L+1: (hidden, doc ids[, router sums]) -> normed hidden (B, T, H)[, router sums]; the document
    ids are not needed after this."""

    def __init__(self, source, names):
        super().__init__()
        self.parts = nn.ModuleList(source.module(n) for n in names)

    def forward(self, inputs):
        x = inputs[0]
        for part in self.parts:
            x = part(x)
        return (x, inputs[2]) if len(inputs) > 2 else x


class LogitTransform:
    """What a CausalLM forward does to logits after the head: softcap (gemma2/3), scaling."""

    def __init__(self, config):
        config = config.get_text_config()  # a multimodal model's LM settings live in its text config
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.multiply = getattr(config, "logit_scale", None)  # cohere
        self.divide = getattr(config, "logits_scaling", None)  # granite

    def __call__(self, logits):
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class LMHead(nn.Module):
    """Layer L+2 when untied: hidden (B, T, H) -> logits (B, T, V)."""

    def __init__(self, source, name, transform):
        super().__init__()
        self.head = source.module(name, allow_missing=False)
        self.transform = transform

    def forward(self, hidden):
        if isinstance(hidden, tuple):  # (hidden, MoE router sums): the loss needs both
            return self.transform(self.head(hidden[0])), hidden[1]
        return self.transform(self.head(hidden))


class TiedLogits:
    """forward_fn of the tied head: logits from the embedding module's weight."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, embed_stage, hidden):
        if isinstance(hidden, tuple):  # (hidden, MoE router sums)
            return self.transform(F.linear(hidden[0], embed_stage.parts[0].weight)), hidden[1]
        return self.transform(F.linear(hidden, embed_stage.parts[0].weight))


def build_generic(source, config) -> PipelineSpec:
    """The L + 3 layer list of a pp-plan causal LM held by `source` (live model or directory)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    names = _module_names(source.skeleton, config)
    pre, blocks, post, head, rotary = names
    transform = LogitTransform(config)
    aux = RouterAux.of(source.skeleton, config)  # MoE with output_router_logits: the aux loss, carried
    tied = _is_tied(source.skeleton, pre[0], head)
    if tied:
        attrs = ["parts.0.weight"]  # only the shared matrix is all-reduced (see models/__init__)
        first = TiedLayerSpec("embed", EmbedStage, source, pre, aux, tied_weight_attr=attrs)
        last = TiedLayerSpec("embed", EmbedStage, source, pre, aux, forward_fn=TiedLogits(transform),
                             tied_weight_attr=attrs)
    else:
        first, last = LayerSpec(EmbedStage, source, pre, aux), LayerSpec(LMHead, source, head, transform)
    layers = [first]
    layers += [LayerSpec(DecoderBlock, source, name, rotary, config, i, aux) for i, name in enumerate(blocks)]
    layers += [LayerSpec(FinalNorm, source, post), last]
    hf_names = [pre] + [[b] for b in blocks] + [post, pre if tied else [head]]
    return PipelineSpec(
        layers=layers, loss_fn=aux.loss_fn if aux else causal_lm_loss,
        kinds=["embed"] + ["block"] * len(blocks) + ["norm", "head"],
        config=config, task="causal-lm", tied={"embed": [0, len(layers) - 1]} if tied else {},
        param_counts=[_numel(source.skeleton, n) for n in hf_names], hf_names=hf_names)


def generic_head(model, config) -> str | None:
    """Why `model`'s CausalLM forward may do more between its base model and its loss than this module's head and
    LogitTransform do (the sweep of bench/arch_sweep.py shows every model type it accepts exact), else None."""
    if getattr(config.get_text_config(), "output_router_logits", False):
        return (f"model_type {config.model_type!r} has output_router_logits: its forward adds the router aux loss, "
                "which pp 1 leaves to HF's own loss")
    if config.model_type == "gpt2":  # its own pipeline builder (models.gpt2); its head: wte's matrix, no transform
        return None
    try:
        _module_names(model, config)
    except ConfigError as exc:
        return str(exc)
    return None


def _module_names(model, config):
    """(pre-layer names, block names, post-layer names, head name, rotary name) in the HF model."""
    from models.discover import decoder_structure

    prefix = model.base_model_prefix
    plan = list(getattr(config, "base_model_pp_plan", None) or {})
    bad = [a for a in _UNSUPPORTED if getattr(config, a, None) not in (None, 1, 1.0)]
    if bad or getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model_type {config.model_type!r}: {bad or 'encoder-decoder'} changes the model's "
                          "forward outside its layers; dstk's generic wrapper would compute something else")
    if getattr(config, "hidden_size_per_layer_input", None):  # gemma3n, gemma4: per-layer inputs (altup, laurel)
        raise ConfigError(f"model_type {config.model_type!r}: hidden_size_per_layer_input "
                          f"{config.hidden_size_per_layer_input}: its base model computes an extra input for every "
                          "layer outside the layers, which dstk's generic wrapper does not send between stages")
    if model.get_output_embeddings() is None:
        raise ConfigError(f"{type(model).__name__} has no LM head: pass a *ForCausalLM model or use task='causal-lm'")
    if "layers" not in plan:  # no pp plan: the standard structure, read from the module tree
        return decoder_structure(model, config)
    cut = plan.index("layers")
    base = model.get_submodule(prefix)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ConfigError(f"model_type {config.model_type!r}: its base_model_pp_plan names 'layers' but "
                          f"{type(base).__name__} has no .layers list of decoder layers; dstk cannot split it")
    _check_no_shared_kv(base.layers[0], config)
    blocks = [f"{prefix}.layers.{i}" for i in range(len(base.layers))]
    rotary = next((f"{prefix}.{n}" for n, m in base.named_children() if "Rotary" in type(m).__name__), None)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    return ([f"{prefix}.{k}" for k in plan[:cut]], blocks, [f"{prefix}.{k}" for k in plan[cut + 1:]], head, rotary)


def _check_no_shared_kv(layer, config) -> None:
    """Layers that store or read other layers' keys/values (gemma4's KV sharing) get them from their base
    model's forward, a dependency between layers that is not the hidden state: refused."""
    for module in layer.modules():
        if "shared_kv_states" in inspect.signature(module.forward).parameters:
            raise ConfigError(f"model_type {config.model_type!r}: {type(module).__name__} takes shared_kv_states: "
                              "layers share keys/values (KV sharing, a dict the base model's forward passes every "
                              "layer), which dstk's pipeline stages do not send between layers")


def _mask_function(config, layer_idx):
    """HF's mask builder for this layer: causal, sliding-window or chunked (from config.layer_types)."""
    from transformers import masking_utils as mu

    by_type = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask,
               "chunked_attention": mu.create_chunked_causal_mask}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # mistral, phi3: one window for all layers, or none
        sliding = getattr(config, "sliding_window", None) is not None
        return mu.create_sliding_window_causal_mask if sliding else mu.create_causal_mask
    if layer_types[layer_idx] not in by_type:
        raise ConfigError(f"model_type {config.model_type!r}: layer {layer_idx} is {layer_types[layer_idx]!r}, not "
                          f"one of the layer kinds dstk builds masks for ({', '.join(sorted(by_type))}): an indexed or "
                          "compressed attention needs its own inputs, a recurrent/linear layer keeps state dstk cannot "
                          "send between stages")
    return by_type[layer_types[layer_idx]]


def _rope_kwargs(rotary, config, layer_idx) -> dict:
    """Rotary modules with one frequency set per layer type (gemma3) take the layer's type."""
    if rotary is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        return {}
    layer_type = config.layer_types[layer_idx]
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params and params[layer_type] is None:  # beam: NoPE layers
        raise ConfigError(f"model_type {config.model_type!r}: layer {layer_idx} ({layer_type}) has no rotary "
                          "parameters; its base model handles those layers' positions outside the layers (e.g. "
                          "position-dependent attention scaling), which dstk's generic wrapper does not reproduce")
    return {"layer_type": layer_type}


def _is_tied(model, embed_name, head_name) -> bool:
    """Whether the LM head's weight is the input embedding's weight (tie_word_embeddings)."""
    return model.get_submodule(head_name).weight is model.get_submodule(embed_name).weight


def _numel(model, names) -> int:
    return sum(p.numel() for n in names for p in model.get_submodule(n).parameters() if p.requires_grad)
