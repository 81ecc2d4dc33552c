"""LoRA on an MoE model's fused experts, a model concern (models.lora.adapters' defaults include them).

transformers 5 holds experts as 3-D parameters (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)), not
nn.Linear modules; peft adapts them through LoraConfig.target_parameters (its lora.ParamWrapper: lora_A (r E, in),
lora_B (out, r E), a rank-r pair per expert; no dropout), wrapping the experts module once per parameter
(experts.base_layer.base_layer.gate_up_proj). Under transformers 5 peft also rewrites a config for the MoE types
whose checkpoints transformers converts (`as_peft_converts`); dstk applies that rewrite itself, so every layout and
the export adapt the same tensors.
"""

import re

PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the HF model: its state dict's names start so


def base_name(name: str) -> str:
    """A PeftModel's name of a base tensor -> the HF model's: no PEFT prefix, no `.base_layer` (an expert
    parameter sits under one per adapted parameter of its module: experts.base_layer.base_layer.down_proj)."""
    return re.sub(r"\.base_layer(?=\.)", "", name.removeprefix(PEFT_PREFIX))


def expert_parameters(model) -> list:
    """The fused experts of the blocks, as suffixes after the block index ("mlp.experts.gate_up_proj"): 3-D
    parameters (E, ., .) held by a module that is not a convolution, which PEFT adapts as target_parameters."""
    from torch import nn

    found = []
    for name, module in model.named_modules():
        parts = base_name(name + ".").rstrip(".").split(".")  # a wrapped model (PeftModel): the HF model's names
        block = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if block is None or isinstance(module, nn.modules.conv._ConvNd):
            continue
        for leaf, p in module.named_parameters(recurse=False):
            suffix = ".".join(parts[block + 1:] + [leaf])
            if len(getattr(p, "ds_shape", p.shape)) == 3 and suffix not in found:  # ZeRO-3: partitioned, ds_shape
                found.append(suffix)
    return found


def frozen_experts(model, config, modules: list) -> str | None:
    """The opening block's sentence on what an MoE model's LoRA leaves frozen: fused experts peft's `config` does
    not adapt, and linears among `modules` (the resolved targets) its conversion took for expert names; or None."""
    adapted = config.target_parameters or ()
    frozen = [e for e in expert_parameters(model) if not any(e == t or e.endswith("." + t) for t in adapted)]
    lost = [m for m in modules if m not in (config.target_modules or ())]
    notes = []
    if frozen:
        why = ("PEFT's LoRA on fused expert parameters takes no dropout; --lora-dropout 0 adapts them"
               if config.lora_dropout else
               f"not in --lora-targets; add {','.join(sorted({e.rsplit('.', 1)[-1] for e in frozen}))} to adapt them")
        notes.append(f"the fused experts stay frozen ({', '.join(frozen)}): {why}")
    if lost:
        notes.append(f"the linears {', '.join(lost)} stay frozen: PEFT (transformers 5) reads those names as this "
                     "model type's experts before fusion and adapts the fused experts instead (gate_up_proj at rank "
                     "x 2)")
    return "; ".join(notes) or None


def as_peft_converts(config, model):
    """`config` as peft's get_peft_model rewrites it for `model` under transformers 5 (peft.utils.
    transformers_weight_conversion, for the MoE types transformers converts checkpoints of): linears named as the
    experts were before fusion (gate_proj, up_proj, down_proj; w1-w3) become the fused expert parameters,
    gate_up_proj at rank and alpha x 2, and those linears (a shared expert, dense blocks) are no longer adapted.
    Done here once, on the whole model, so that a stage injecting into its own layers (StageAdapters, where peft
    sees no model config) adapts what get_peft_model does at pp 1 and in export, and PeftModel.from_pretrained
    reads the saved adapter_config.json as written (converting it again changes nothing)."""
    from peft.utils.transformers_weight_conversion import (convert_peft_config_for_transformers,
                                                           get_model_conversion_mapping)

    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    return config
