"""What DeepSpeed's AutoEP (expert parallelism, module_inject/auto_ep*.py) needs of a transformers model.

AutoEP replaces each MoE block (`model.layers.N.mlp`, matched by re.fullmatch on the module's name,
auto_ep.py:429) with an AutoEPMoELayer inside deepspeed.initialize, and moves HF's router-logit recorders (the
router aux loss reads them) onto the new layer. To do that, DeepSpeed 0.19.8 reads and writes transformers'
output-capture registry as a plain dict keyed by class-name strings (auto_ep_presets/base.py:326
`registry.get(key, default)`, :364 `registry.get(key)`, :305 `registry[key] = entry`). transformers 5.24 made it a
dict subclass whose get() and []= take a MODEL and key it by str(model.__class__) (utils/output_capturing.py:39-50):
the two-argument get raises "TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given"
at deepspeed.initialize, and a one-argument get with a string would silently find nothing.

`allow_string_keys()` gives the registry object both readings: a string key is a plain dict key (what DeepSpeed
passes), anything else is transformers' model (what transformers passes). The keys are the same strings either way,
so nothing either side stores changes.

`hf_shapes` gives a saved model's parameter shapes by HF name (what a checkpoint of AutoEP's tensors becomes).
"""

import contextlib
import functools
import logging
import re


def allow_string_keys() -> None:
    """Let transformers' output-capture registry take DeepSpeed's class-name keys too (idempotent; a no-op where
    the registry is a plain dict, as in the transformers releases DeepSpeed's AutoEP was written against)."""
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None or type(registry) is dict or getattr(registry, "dstk_string_keys", False):
        return

    class StringKeys(type(registry)):
        dstk_string_keys = True

        def get(self, key, default=None):
            return dict.get(self, key, default) if isinstance(key, str) else super().get(key)

        def __setitem__(self, key, value):
            if isinstance(key, str):
                dict.__setitem__(self, key, value)
            else:
                super().__setitem__(key, value)

    registry.__class__ = StringKeys


def replace_stage_experts(holder, config, section: dict, pp: int) -> list:
    """Expert parallelism inside pipeline stages: AutoEP's replacement, done by dstk where DeepSpeed's engine would
    do it at pp 1 (runtime/engine.py:816-913 `_configure_expert_parallel`), on one stage's MoE blocks; returns the
    AutoEPMoELayers put in place. holder: the stage's blocks under their HF names (toolkit.distributed.
    tensor_parallel.stage_holder), so the presets' re.fullmatch of model.layers.N.mlp (auto_ep.py:429) finds them.

    The groups come first, on every rank in the same order (new_group is collective): DeepSpeed's own
    `_create_expert_and_data_parallel` (utils/groups.py:370-471) told pp, which cuts the world into pp runs of
    world / pp ranks, the stages of DeepSpeed's pipe-major grid, and inside each: ep groups of ep consecutive ranks,
    expert-data groups of the ranks ep apart (:433-438). The engine later finds the AutoEPMoELayers
    (engine.py:2097-2106: has_moe_layers), binds them to these groups (set_deepspeed_parallelism, auto_ep_layer.py:
    789: the group exists, nothing is made again) and reduces expert gradients over the expert-data group."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_post_detection
    from deepspeed.utils import groups, logger
    import deepspeed.comm as dist

    autoep = parse_autoep_config(section)
    ep = autoep.autoep_size
    groups._create_expert_and_data_parallel(expert_parallel_size_=ep, mp_size=1, pp_size=pp, mp_mode="sp")
    ep_rank = dist.get_rank(group=groups._get_expert_parallel_group(f"ep_size_{ep}"))
    holder.config = config  # AutoEP reads num_experts, top_k and the model type from model.config (auto_ep.py:415)
    replacer = AutoEP(holder, autoep)
    specs = replacer.ep_parser()  # [] on a stage without blocks (the embedding or head alone)
    if specs:
        validate_autoep_post_detection(autoep, specs)
        with _quiet(logger):  # its HF recorder retarget looks for a model class the holder is not, and warns;
            replacer.replace_moe_layers(specs, ep_size=ep, ep_rank=ep_rank)  # dstk watches the gates (models.moe)
    del holder.config
    return [holder.get_submodule(s.moe_module_name) for s in specs]


@contextlib.contextmanager
def _quiet(logger):
    """`logger` at ERROR for the block (its warnings dropped), its own level after."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# An AutoEPMoELayer's parameters under a MoE block BLOCK (module_inject/auto_ep_layer.py): the router's
# BLOCK.router.gate.weight [E, H] (+ .bias), and the experts BLOCK.experts.w1 / w3 [E_local, I, H] (gate, up) and
# w2 [E_local, H, I] (down), E_local = E / ep experts of this rank (ep_repack.py repack_expert_weights). The router
# is also reachable as BLOCK.<router name> (an alias AutoEP sets for HF's output recorders): one tensor, two names.
# DeepSeek-V3's router also holds e_score_correction_bias [E] (a buffer: it shifts which experts are picked, is not
# trained, and a pretrained model's is not zero), which AutoEP copies from HF's BLOCK.gate onto BLOCK.router
# (auto_ep_layer.py:131 _copy_e_score_correction_bias).
EXPERT = re.compile(r"(.+)\.experts\.(w[123])")
ROUTER = re.compile(r"(.+)\.router\.gate\.(weight|bias)")
ROUTER_BUFFER = re.compile(r"(.+)\.router\.(e_score_correction_bias)")


def is_autoep_name(name: str) -> bool:
    return bool(EXPERT.fullmatch(name) or ROUTER.fullmatch(name) or ROUTER_BUFFER.fullmatch(name))


def preset_names(preset: str) -> dict:
    """The HF names DeepSpeed's preset `preset` maps (auto_ep_presets/*.py): router, experts, w1/w2/w3 (w3 None:
    gate and up fused in w1's tensor, as transformers 5 holds them)."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    p = PRESET_MODELS[preset]
    return {"router": p.router_pattern, "experts": p.experts_pattern, "w1": p.expert_w1, "w2": p.expert_w2,
            "w3": p.expert_w3}


def to_hf(tensors: dict, names: dict, shapes: dict) -> dict:
    """AutoEP's tensors of every expert (w1/w2/w3 [E, ...], all ranks' experts in order) -> the HF model's
    (`shapes`: HF name -> shape, the model's own parameters), the inverse of ep_repack._repack_fused_3d: gate and up
    joined along the projection's output (HF [E, 2I, H], or transposed where the HF model holds [E, H, 2I]).
    Anything else keeps its name. The same map serves the weights and each Adam moment (elementwise)."""
    import torch

    out, blocks = {}, {}
    for name, tensor in tensors.items():
        expert, router = EXPERT.fullmatch(name), ROUTER.fullmatch(name) or ROUTER_BUFFER.fullmatch(name)
        if expert:
            blocks.setdefault(expert.group(1), {})[expert.group(2)] = tensor
        elif router:  # BLOCK.router.gate.weight -> BLOCK.gate.weight, BLOCK.router.e_score_correction_bias -> BLOCK.gate.e_...
            out[f"{router.group(1)}.{names['router']}.{router.group(2)}"] = tensor
        else:
            out[name] = tensor
    for block, w in blocks.items():
        experts = f"{block}.{names['experts']}"
        if names["w3"] is None:  # fused gate_up
            parts = {names["w1"]: torch.cat([w["w1"], w["w3"]], dim=1), names["w2"]: w["w2"]}
        else:
            parts = {names["w1"]: w["w1"], names["w2"]: w["w2"], names["w3"]: w["w3"]}
        for short, tensor in parts.items():
            want = tuple(shapes[f"{experts}.{short}"])
            out[f"{experts}.{short}"] = tensor if tuple(tensor.shape) == want else tensor.transpose(1, 2).contiguous()
    return out


def layers(module) -> dict:
    """{block name: AutoEPMoELayer} of a module DeepSpeed's AutoEP replaced blocks of ({} for any other)."""
    return {name: m for name, m in module.named_modules() if type(m).__name__ == "AutoEPMoELayer"}


def from_hf(tensors: dict, block: str, layer, names: dict) -> dict:
    """This rank's share of the HF tensors of MoE block `block` as AutoEP layer `layer` holds them (to_hf's inverse:
    its local experts cut from the fused tensors, gate and up split), by the layer's parameter names under `block`.
    `tensors`: HF name -> tensor shaped as the HF model holds it (the weights, or one Adam moment)."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    local = autoep_experts_for_rank(layer.expert_placement_descriptor, layer.ep_rank)  # global ids, packed order
    experts, w1_shape = f"{block}.{names['experts']}", _shape(layer.experts.w1)  # [E_local, I, H]

    def ours(hf: str, want: tuple):  # [E, a, b] HF tensor -> this rank's experts in AutoEP's orientation
        full = tensors[hf]
        full = full if tuple(full.shape[1:]) == want[1:] else full.transpose(1, 2)
        return full[local].contiguous()

    out = {f"{block}.router.gate.{kind}": tensors[f"{block}.{names['router']}.{kind}"]
           for kind in ("weight", "bias") if f"{block}.{names['router']}.{kind}" in tensors}
    bias = f"{block}.{names['router']}.e_score_correction_bias"
    if bias in tensors:  # DeepSeek's router buffer (the weights only: it has no moments)
        out[f"{block}.router.e_score_correction_bias"] = tensors[bias]
    if names["w3"] is None:  # gate_up fused: [E, 2I, H] -> w1 = gate, w3 = up
        both = ours(f"{experts}.{names['w1']}", (w1_shape[0], 2 * w1_shape[1], w1_shape[2]))
        out[f"{block}.experts.w1"], out[f"{block}.experts.w3"] = both.split(w1_shape[1], dim=1)
    else:
        out[f"{block}.experts.w1"] = ours(f"{experts}.{names['w1']}", w1_shape)
        out[f"{block}.experts.w3"] = ours(f"{experts}.{names['w3']}", w1_shape)
    out[f"{block}.experts.w2"] = ours(f"{experts}.{names['w2']}", _shape(layer.experts.w2))
    return {k: v.contiguous() for k, v in out.items()}


def _shape(param) -> tuple:
    """A parameter's whole shape on this rank (under ZeRO-3 the tensor is an empty placeholder: ds_shape)."""
    return tuple(getattr(param, "ds_shape", param.shape))


@functools.lru_cache(maxsize=4)
def hf_shapes(meta, task: str) -> dict:
    """{HF name: shape} of the model in META (config.json), built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig

    from models.api import auto_class

    config = AutoConfig.from_pretrained(meta)
    with torch.device("meta"), _no_zero_init():
        model = auto_class(task, config)._from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@contextlib.contextmanager
def _no_zero_init():
    """transformers' HfDeepSpeedConfig off for the block: on a ZeRO-3 rank (a move onto ZeRO-3 reads the checkpoint
    on rank 0 alone) it is alive, and _from_config would build inside deepspeed.zero.Init, whose collectives wait
    for the other ranks forever. transformers holds it by weak reference (integrations/deepspeed.py); put back after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    live = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if live is not None:
            hf_deepspeed.set_hf_deepspeed_config(live)
