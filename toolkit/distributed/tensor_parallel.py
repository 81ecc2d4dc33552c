"""Tensor parallelism inside pipeline stages (3D: dp x pp x tp), which DeepSpeed 0.19 does not offer.

DeepSpeed's AutoTP training path (`"tensor_parallel": {"autotp_size": N}` handed to
deepspeed.initialize) cannot run under its PipelineEngine: `_configure_tensor_parallel_states`
(runtime/engine.py:957-958) replaces the pipeline grid with a (world / tp, tp) mesh that has no pipe
axis, so the stages of one pipeline are taken for data-parallel replicas and the model broadcast
(`_broadcast_model`, engine.py:2059) mixes the stages' different parameters. What DeepSpeed does
offer, and what this module combines:
- PipelineModule over PipeModelDataParallelTopology(pp, tp, dp): a grid whose "model" axis is the
  tp group (`get_slice_parallel_group`), whose data-parallel group leaves that axis out, and whose
  activations travel between the same tp rank of neighbouring stages. Megatron-DeepSpeed trains on it.
- AutoTP's layer replacement (module_inject.auto_tp.AutoTP, the same plan DeepSpeed would use at
  pp = 1: the config's preset_model / partition_config, else the model's HF tp plan), run by dstk on
  each stage's decoder blocks with the stage's tp group. Column-parallel projections all-reduce their
  input's gradient and row-parallel ones their output, so every replicated tensor (the hidden state,
  norms, embedding, head) is identical on a stage's tp ranks; the engine is told nothing of tp (its
  config goes without "tensor_parallel").

Expert parallelism inside stages (pp x dp x ep) is built the same way: AutoEP's replacement (module_inject/
auto_ep.py) run by dstk on the stage's blocks under their HF names, over DeepSpeed's own ep groups made with the
pipeline's pp (shard_stage_experts, models.autoep); the engine's config goes without "expert_parallel".

The embedding, final norm and head stay whole on every tp rank (a tied embedding stays a pipeline
tied layer). Gradient norms count a sharded tensor on every tp rank and a replicated one on tp rank 0
(models.pipeline marks which; DeepSpeed sums the norm over the pipe x tp group).
"""

from toolkit.errors import ConfigError


def partition_plan(config, skeleton, section: dict, tp: int):
    """AutoTP's layer specs (deepspeed.module_inject.autotp_config.AutoTPConfig) for this model, chosen
    as DeepSpeed chooses at pp = 1 (engine._apply_autotp_partitioning): the config's preset_model /
    partition_config, else the model's HF tp plan. skeleton: the HF model on the meta device."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan, get_tensor_parallel_config

    custom = get_tensor_parallel_config({"tensor_parallel": section}).get_partition_config_object()
    if custom is not None:
        custom.tp_size = tp
        return custom
    plan = _get_hf_tp_plan(skeleton)
    try:
        specs = TPPlanConverter.convert(plan) if plan else None
    except ValueError as exc:  # a style DeepSpeed does not know (MoE experts' "local_colwise", ...)
        raise ConfigError(f"tensor_parallel.autotp_size {tp} with pipeline stages: DeepSpeed cannot use "
                          f"{config.model_type}'s tp plan ({str(exc).split('. ')[0]}); give \"partition_config\" "
                          "in \"tensor_parallel\", or train it without tensor_parallel") from None
    if not specs:
        raise ConfigError(f"tensor_parallel.autotp_size {tp}: {config.model_type} has no tensor-parallel plan; "
                          'give "preset_model" or "partition_config" in "tensor_parallel", or drop it')
    return AutoTPConfig(tp_size=tp, layer_specs=specs)


def shard_stage(module, spec, hf_names: list, config, plan, tp: int) -> dict:
    """Shard this rank's decoder blocks of `module` (models.build_pipeline_module's PipelineModule on a
    PipeModelDataParallelTopology) over its tp group, in place; returns AutoTP's map of the shards
    (universal_checkpoint_info, by HF name: what export merges them with). hf_names: per layer, {state-
    dict key: HF name} (pipe.hf_name_map).

    The blocks' HF modules are gathered under their HF names ("model.layers.3") in one holder module,
    so AutoTP's patterns match as they would on the whole model; replacing a projection there replaces
    it inside the pipeline layer that shares the module."""
    from deepspeed.module_inject import set_autotp_mode
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info
    from torch import nn

    holder = stage_holder(module, spec, hf_names)
    set_autotp_mode(training=True)  # AutoTP's layers train (gradients, their backward collectives)
    autotp = AutoTP(module=holder, all_reduce_linears=(), prefix="", state_dict=None,
                    linear_layer_setting=(nn.Linear, nn.Embedding), orig_layer_impl=None, keep_module_on_host=False,
                    partition_config=plan, model_config=config, training_mode=True)
    # set_tensor_parallel_config() takes DeepSpeed's global tp group in training mode (auto_tp.py:397-400),
    # which has no pipe axis; the stage's group is the grid's slice group
    autotp.mp_group, autotp.mp_size = module._grid.get_slice_parallel_group(), tp
    autotp.update_linear_policies()
    autotp._replace_module(holder)
    autotp.register_replicated_grad_hooks(holder)  # e.g. qwen3's q/k norms over sharded heads
    sharded = [n for n, p in holder.named_parameters() if getattr(p, "tensor_model_parallel", False)]
    if any(spec.kinds[i] == "block" for i in range(module._local_start, module._local_stop)) and not sharded:
        raise ConfigError(f"tensor_parallel.autotp_size {tp}: the plan shards none of {config.model_type}'s block "
                          "projections here; check its \"partition_config\" patterns")
    return collect_autotp_universal_checkpoint_info(holder)


def stage_holder(module, spec, hf_names: list):
    """This rank's decoder blocks of pipeline `module` gathered under their HF names ("model.layers.3") in one
    holder module, whose sub-modules ARE the stage's: DeepSpeed's AutoTP and AutoEP find them by those names as on
    the whole model, and replacing a module in the holder replaces it in the pipeline layer that shares it."""
    from torch import nn

    holder = nn.Module()
    for index in range(module._local_start, module._local_stop):
        if spec.kinds[index] == "block":
            for hf_name in spec.hf_names[index]:
                _attach(holder, hf_name, _local_module(module.forward_funcs[index - module._local_start], hf_name,
                                                       hf_names[index]))
    return holder


def _local_module(layer, hf_name: str, names: dict):
    """The sub-module of pipeline layer `layer` that is HF module `hf_name`, found through the layer's
    {state-dict key: HF name} map (pipe.hf_name_map): "layer.mlp.up_proj.weight" -> "model.layers.3.mlp.
    up_proj.weight" says the block holds model.layers.3 as `.layer`."""
    for key, full in names.items():
        if full.startswith(hf_name + "."):
            local = key[: len(key) - len(full) + len(hf_name)]
            return layer.get_submodule(local) if local else layer
    raise ConfigError(f"pipeline layer {type(layer).__name__} holds no tensor of {hf_name}")


def _attach(holder, dotted: str, module) -> None:
    from torch import nn

    *parents, leaf = dotted.split(".")
    node = holder
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


def shard_stage_experts(module, spec, hf_names: list, section: dict, pp: int) -> None:
    """Expert parallelism inside pipeline stages (pp x dp x ep): this rank's MoE blocks replaced by AutoEP's layers
    holding experts / ep of each block (models.autoep.replace_stage_experts), and the MoE router aux loss's capture
    (models.moe.RouterCapture) moved onto each new layer's router gate, the Linear whose output is the router logits
    (what DeepSpeed's Mixtral recorder retargets to at pp 1, auto_ep_presets/base.py:453)."""
    from models.autoep import allow_string_keys, replace_stage_experts

    allow_string_keys()
    replace_stage_experts(stage_holder(module, spec, hf_names), spec.config, section, pp)
    for layer in module.forward_funcs:
        routers = getattr(layer, "routers", None)
        for sub in (layer.modules() if routers is not None else ()):
            if type(sub).__name__ == "AutoEPMoELayer":
                if sub.return_router_logits:  # its forward calls the gate a second time (auto_ep_layer.py:908-912)
                    raise ConfigError(f"{spec.config.model_type}: AutoEP's layer returns router logits to its block "
                                      "(an older MoE forward), which dstk's pipeline aux loss does not read; set "
                                      "output_router_logits false in config.json, or train it at pp 1")
                routers.watch(sub.router.gate)
