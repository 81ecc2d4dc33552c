"""pp > 1: the HF model as a PipelineModule on dstk's partition, and the layer -> HF name map
that export needs to turn layer_XX-model_states.pt files back into a HF state dict."""

from toolkit.errors import ConfigError

TASKS = {"causal-lm": "causal-lm", "classification": "sequence-classification"}


def pipeline_module(model, task: str, topo, cfg: dict):
    """(PipelineModule over PipeDataParallelTopology(pp, dp), layout for checkpoint.save_meta)."""
    import models
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    spec = models.pipeline_layers(model, task=TASKS[task])
    if topo.pp > spec.num_layers:
        raise ConfigError(f"pp {topo.pp} is more stages than the model's {spec.num_layers} pipeline layers "
                          f"(embedding, blocks, head); use pp <= {spec.num_layers}")
    parts = choose_parts(spec, topo.pp, cfg)
    layout = {"pp": topo.pp, "parts": parts, "hf_names": hf_name_map(model, spec)}
    module = models.build_pipeline_module(spec, topology=PipeDataParallelTopology(num_pp=topo.pp, num_dp=topo.dp),
                                          parts=parts)
    return module, layout


def choose_parts(spec, pp: int, cfg: dict) -> list:
    """The config's pipeline.parts, else dstk's partition by its pipeline.partition_method."""
    section = cfg.get("pipeline") or {}
    if section.get("parts"):
        return list(section["parts"])
    method = section.get("partition_method", "compute")
    from toolkit import partition

    costs = _costs(spec, cfg)
    if costs is None or method in ("parameters",):  # no cost model: balance parameters (DeepSpeed's way)
        return partition.partition_balanced(spec.param_counts, pp)
    return partition.partition_layers(costs, pp, method=method)


def _costs(spec, cfg: dict):
    """toolkit.costs per layer when its layer list matches the spec's, else None."""
    from toolkit.arch import arch_from_config
    from toolkit.costs import layer_costs

    try:
        arch = arch_from_config(spec.config.to_dict(), name=spec.config.model_type)
        costs = layer_costs(arch, seq_len=128, mbs=cfg.get("train_micro_batch_size_per_gpu") or 1,
                            precision="bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp32")
    except (ConfigError, KeyError, TypeError, ValueError):
        return None
    return costs if len(costs) == spec.num_layers else None


def hf_name_map(model, spec) -> list:
    """Per layer, {key in that layer's state_dict: HF state-dict name}, found by tensor identity.

    The spec wraps the live model's own modules, so a layer's tensors ARE the model's tensors."""
    by_id = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), name)  # a tied weight keeps its first name (the embedding's)
    names = []
    for layer in spec.layers:
        built = layer.build() if hasattr(layer, "build") else layer
        names.append({k: by_id[id(t)] for k, t in built.state_dict(keep_vars=True).items() if id(t) in by_id})
    return names
