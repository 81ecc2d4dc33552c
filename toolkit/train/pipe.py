"""pp > 1: the HF model as a PipelineModule on dstk's partition, and the layer -> HF name map
that export needs to turn layer_XX-model_states.pt files back into a HF state dict.

A local HF directory is never built whole: models.pipeline_layers(dir) gives LayerSpecs that each
read only their own tensors (safetensors) on the stage that owns them. Built-in names arrive as
a live (tiny, seeded) model, the same on every rank, whose modules the layers share.
"""

import contextlib
import io
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.train.hf import MODEL_TASKS


def pipeline_module(model, task: str, topo, cfg: dict, *, seq_len: int = 128, config=None, verbose: bool = False):
    """(PipelineModule over PipeDataParallelTopology(pp, dp), layout for checkpoint.save_meta).

    model: a HF model in memory, or a local HF directory (str/Path: loaded per stage).
    config: the run's HF config; checked against the directory's (num_labels) when given."""
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    import models

    is_dir = isinstance(model, (str, Path))
    spec = models.pipeline_layers(str(model) if is_dir else model, task=MODEL_TASKS[task])
    if is_dir and config is not None:
        _check_labels(str(model), spec.config, config)
    if topo.pp > spec.num_layers:
        raise ConfigError(f"pp {topo.pp} is more stages than the model's {spec.num_layers} pipeline layers "
                          f"(embedding, blocks, head); use pp <= {spec.num_layers}")
    parts = choose_parts(spec, topo.pp, cfg, seq_len)
    layout = {"pp": topo.pp, "parts": parts, "hf_names": hf_name_map(spec)}
    # no_grad: PipelineModule broadcasts tied weights in place while it is built; with autograd on, torch
    # marks the parameter and warns at every backward that c10d::broadcast_ has no autograd kernel
    # ("may lead to silently incorrect behavior"). The gradients were right either way (a broadcast
    # into a leaf keeps it a leaf); built under no_grad there is nothing to warn about.
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())  # its prints
    with torch.no_grad(), quiet:
        module = models.build_pipeline_module(spec, topology=PipeDataParallelTopology(num_pp=topo.pp, num_dp=topo.dp),
                                              parts=parts)
    return module, layout


def _check_labels(path: str, saved, wanted) -> None:
    """The directory's config decides the classifier's shape: it must have the data's label count."""
    if getattr(wanted, "num_labels", None) != getattr(saved, "num_labels", None):
        raise ConfigError(f"{path}/config.json has num_labels {saved.num_labels} but the data has "
                          f"{wanted.num_labels} labels (0..{wanted.num_labels - 1}); set \"num_labels\": "
                          f"{wanted.num_labels} (and id2label) in config.json, or use pp 1")


def choose_parts(spec, pp: int, cfg: dict, seq_len: int = 128) -> list:
    """The config's pipeline.parts, else dstk's partition by its pipeline.partition_method."""
    section = cfg.get("pipeline") or {}
    if section.get("parts"):
        return list(section["parts"])
    method = section.get("partition_method", "compute")
    from toolkit.plan import partition

    costs = _costs(spec, cfg, seq_len)
    if costs is None or method in ("parameters",):  # no cost model: balance parameters (DeepSpeed's way)
        return partition.partition_balanced(spec.param_counts, pp)
    return partition.partition_layers(costs, pp, method=method)


def _costs(spec, cfg: dict, seq_len: int):
    """toolkit.plan.costs per layer (for rows of seq_len tokens) when its layer list matches the spec's, else None."""
    from toolkit.plan.arch import arch_from_config
    from toolkit.plan.costs import layer_costs

    try:
        arch = arch_from_config(spec.config.to_dict(), name=spec.config.model_type)
        costs = layer_costs(arch, seq_len=seq_len, mbs=cfg.get("train_micro_batch_size_per_gpu") or 1,
                            precision="bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp32")
    except (ConfigError, KeyError, TypeError, ValueError):
        return None
    return costs if len(costs) == spec.num_layers else None


def hf_name_map(spec) -> list:
    """Per layer, {key in that layer's state_dict: HF state-dict name}.

    The keys come from the same layer list built over a meta-device copy of the model (shapes only:
    no memory, no weights read), whose tensors ARE that copy's tensors; each layer may only map to
    names under its spec.hf_names entry."""
    import models
    import torch

    with torch.device("meta"):
        skeleton = models.auto_class(spec.task).from_config(spec.config)
    by_id = {}
    for name, t in skeleton.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), name)  # a tied weight keeps its first name (the embedding's)
    meta_spec = models.pipeline_layers(skeleton, task=spec.task)
    names = []
    for layer, owned in zip(meta_spec.layers, spec.hf_names):
        built = layer.build() if hasattr(layer, "build") else layer
        found = {k: by_id[id(t)] for k, t in built.state_dict(keep_vars=True).items() if id(t) in by_id}
        stray = [hf for hf in found.values() if not any(hf == n or hf.startswith(n + ".") for n in owned)]
        if stray:
            raise ConfigError(f"layer {len(names)} holds {stray[:3]}, outside its HF modules {owned}")
        names.append(found)
    return names
