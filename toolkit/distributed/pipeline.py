"""pp > 1: the HF model as a PipelineModule on dstk's partition, and the layer -> HF name map
that export needs to turn layer_XX-model_states.pt files back into a HF state dict.

A local HF directory is never built whole: models.pipeline_layers(dir) gives LayerSpecs that each
read only their own tensors (safetensors) on the stage that owns them, in the dtype DeepSpeed trains
the parameters in (models.weights.loading.param_dtype: a bf16 run never holds them in fp32). Built-in names arrive as
a live (tiny, seeded) model, the same on every rank, whose modules the layers share.

LoRA (`lora=` settings): a live model arrives already wrapped (models.lora.adapters.apply, its HF model
inside); a directory's stages inject the adapters into each module they read (lora.StageAdapters).
The layer -> name map then holds the PeftModel's names ("base_model.model.model.layers.0.self_attn.
q_proj.lora_A.default.weight"), so export rebuilds the PeftModel and writes PEFT's adapter files.
"""

import contextlib
import io
import logging
from pathlib import Path

from toolkit.errors import ConfigError
from models.weights.loading import param_dtype
from models.lora.adapters import StageAdapters, is_adapter, manifest_entry, peft_config, wrap
from models.lora.experts import PEFT_PREFIX

log = logging.getLogger(__name__)


def pipeline_module(model, task: str, topo, cfg: dict, *, seq_len: int = 128, config=None, verbose: bool = False,
                    lora=None, seed: int = 0, schedule: str = "1f1b", tiled_loss: str = "off",
                    tiled_mlp: str = "off", offload_activations: str = "off", objective=None):
    """(PipelineModule over PipeDataParallelTopology(pp, dp), or PipeModelDataParallelTopology(pp, tp, dp)
    with each stage's blocks sharded over its tp group (toolkit.distributed.tensor_parallel); the run's
    manifest entries: pp, parts, hf_names, tied (+ lora, tp), for checkpoint.manifest.save_meta).

    model: a HF model in memory, or a local HF directory (str/Path: loaded per stage).
    config: the run's HF config; checked against the directory's (num_labels) when given.
    lora: LoraSettings (needs config); a model in memory must be the HF model inside lora.apply's
    PeftModel. seed: the adapters' (lora.init_adapters). schedule "dualpipev": a DualPipeVModule cut into 2 pp
    stages by the same partitioner (toolkit.distributed.dualpipev), rank r holding stages r and 2 pp - 1 - r.
    tiled_loss: --tiled-loss (auto, on, off): the last stage's loss takes the head and computes it in tiles of
    tokens (models.tiled.loss); the module's dstk_tiled_loss says (on, why). tiled_mlp: --tiled-mlp (auto, on, off):
    the stage's dense MLPs through TiledMLP (models.tiled.mlp); its dstk_tiled_mlp says (on, why, shards).
    offload_activations: --offload-activations (auto, on, off): the checkpointed layers' inputs to host memory
    (models.tiled.offload); its dstk_offload_activations says (on, why). objective: --objective dpo's DpoLoss
    (models.objectives), the last stage's loss (each row's log-prob, then the pairs'), dropout off, the head untiled."""
    import torch

    import models
    from models.pipeline import place

    is_dir = isinstance(model, (str, Path))
    attention = getattr(config, "_attn_implementation", None) if config is not None else None
    skeleton = _skeleton_for_lora(config, task) if lora is not None else None
    adapters = peft_config(skeleton, lora, task) if lora is not None else None
    adapt = StageAdapters(adapters, task, seed) if adapters is not None and is_dir else None
    spec = models.pipeline_layers(str(model) if is_dir else model, task=task, attention=attention,
                                  adapt=adapt, dtype=param_dtype(cfg))  # no fp32 copy of a bf16 run's weights
    if is_dir and config is not None:
        _check_labels(str(model), spec.config, config)
    dual = schedule == "dualpipev"
    stages = topo.pp * (2 if dual else 1)
    if stages > spec.num_layers:
        what = (f"pp {topo.pp} under --schedule dualpipev is {stages} stages, more" if dual
                else f"pp {topo.pp} is more stages")
        raise ConfigError(f"{what} than the model's {spec.num_layers} pipeline layers (embedding, blocks, head); use "
                          f"pp <= {spec.num_layers // (2 if dual else 1)}")
    parts, fallback = choose_parts(spec, stages, cfg, seq_len)
    if fallback and _is_rank0():
        log.warning("dstk: %s", fallback)
    record = {"pp": topo.pp, "parts": parts, "hf_names": hf_name_map(spec, adapters), "tied": dict(spec.tied)}
    if dual:
        record["schedule"] = schedule
    if lora is not None:
        record["lora"] = manifest_entry(lora, skeleton, task)
        _check_every_stage_trains(record, spec)
    # no_grad: PipelineModule broadcasts tied weights in place while it is built; with autograd on, torch
    # marks the parameter and warns at every backward that c10d::broadcast_ has no autograd kernel
    # ("may lead to silently incorrect behavior"). The gradients were right either way (a broadcast
    # into a leaf keeps it a leaf); built under no_grad there is nothing to warn about.
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())  # its prints
    plan = _tp_plan(spec.config, task, cfg, topo.tp) if topo.tp > 1 else None  # refused before anything is built
    with torch.no_grad(), quiet:
        module = models.build_pipeline_module(spec, topology=_topology(topo), parts=parts, on_host=True, dual=dual,
                                              activation_checkpoint_interval=checkpoint_interval(cfg))
        _finish_on_host(module, spec, record, cfg, plan, topo.tp)
        place(module)  # the stage as it trains (cast, sharded) to its device: nothing bigger goes there first
    if topo.sp > 1:
        _sequence_parallel(module, spec, topo, cfg)
        record["sp"] = topo.sp
    if objective is not None:
        from models.objectives import disable_dropout

        module.loss_fn = objective  # reads (labels, ref_logps): the reference travels with the labels
        disable_dropout(module)
    _tile_loss(module, spec, topo, cfg, seq_len, tiled_loss, schedule, objective is not None)
    _tile_mlp(module, spec, topo, cfg, seq_len, tiled_mlp)
    _offload(module, spec, topo, cfg, seq_len, offload_activations)
    if plan is not None:
        models.mark_grad_norm_owners(module)
        record["tp"] = topo.tp
    if lora is not None:
        for name, p in module.named_parameters():  # PEFT's rule: adapters (and a classifier's copy) train
            p.requires_grad_(is_adapter(name))
    return module, record


def _finish_on_host(module, spec, record: dict, cfg: dict, plan, tp: int) -> None:
    """Make a stage built on the host what it trains as: parameters in the dtype DeepSpeed's engine casts
    them to (a built-in model and LoRA's adapters arrive in fp32), then its blocks sharded over the tp group
    (AutoTP copies each shard to the accelerator and frees the whole tensor)."""
    from models.pipeline import cast_parameters

    cast_parameters(module, param_dtype(cfg))
    if plan is not None:
        from toolkit.distributed.tensor_parallel import shard_stage

        module.dstk_tp_info = shard_stage(module, spec, record["hf_names"], spec.config, plan, tp)
    if (cfg.get("expert_parallel") or {}).get("enabled") is True:
        from toolkit.distributed.tensor_parallel import shard_stage_experts

        shard_stage_experts(module, spec, record["hf_names"], cfg["expert_parallel"], record["pp"])


def _topology(topo):
    """DeepSpeed's grid for pp x dp (x tp: a "model" axis, the fastest, as dstk's Topology orders ranks; x sp:
    a stage's sp ranks are data-parallel ranks to DeepSpeed, toolkit.distributed.sequence_parallel)."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    if topo.tp > 1:
        return PipeModelDataParallelTopology(num_pp=topo.pp, num_mp=topo.tp, num_dp=topo.dp)
    return PipeDataParallelTopology(num_pp=topo.pp, num_dp=topo.dp * topo.sp)


def _sequence_parallel(module, spec, topo, cfg: dict) -> None:
    """Ulysses inside the stages (toolkit.distributed.sequence_parallel): its groups and attention, this rank's
    slice for each block, and the loss over a slice."""
    import torch.distributed as dist

    from toolkit.distributed.sequence_parallel import PipelineLoss, register, shard_stage
    from toolkit.distributed.topology import config_batch

    shard_stage(module, spec.kinds, topo.sp, topo.sp_rank(dist.get_rank()))
    register(spec.config, topo.sp, config_batch(cfg, topo.dp).mbs)
    module.loss_fn = PipelineLoss(topo.sp)


def _tile_loss(module, spec, topo, cfg: dict, seq_len: int, mode: str, schedule: str, dpo: bool = False) -> None:
    """--tiled-loss for a pipeline (models.tiled.loss.choose: the same answer on every rank): the head stage's
    loss tiled; module.dstk_tiled_loss = (on, why)."""
    from models.tiled.loss import choose, tile_pipeline_head
    from toolkit.distributed.topology import config_batch

    blocker = None
    if spec.task != "causal-lm":
        blocker = f"--task {spec.task}: only the causal LM loss is tiled"
    elif schedule == "dualpipev":
        blocker = "--schedule dualpipev computes its loss on rank 0's head stage, which dstk does not tile"
    elif dpo:
        blocker = "--objective dpo scores each row from the whole logits"
    vocab = spec.config.get_text_config().vocab_size
    tokens = config_batch(cfg, topo.dp).mbs * seq_len // topo.sp
    module.dstk_tiled_loss = choose(mode, tokens, vocab, blocker)
    if module.dstk_tiled_loss[0]:
        tile_pipeline_head(module, vocab)


def _tile_mlp(module, spec, topo, cfg: dict, seq_len: int, mode: str) -> None:
    """--tiled-mlp for a pipeline: decided on the model's skeleton (meta device), so every rank answers the same
    whatever blocks its stage holds; the MLPs this stage holds patched; module.dstk_tiled_mlp = (on, why, shards)."""
    from models.tiled.mlp import decide, layout_blocker, patch_mlps, widths
    from toolkit.distributed.topology import config_batch

    blocker = layout_blocker(topo.tp)
    tokens = config_batch(cfg, topo.dp).mbs * seq_len // topo.sp
    module.dstk_tiled_mlp = decide(mode, _skeleton(spec.config, spec.task), spec.config, tokens,
                                   param_dtype(cfg).itemsize, blocker, seq_len // topo.sp)
    if module.dstk_tiled_mlp[0]:
        patch_mlps(module, widths(spec.config)[0])


def _offload(module, spec, topo, cfg: dict, seq_len: int, mode: str) -> None:
    """--offload-activations for a pipeline (models.tiled.offload.decide, on the stage's share of the blocks: every
    rank answers the same): deepspeed.checkpointing's cpu_checkpointing set accordingly; module.dstk_offload_activations
    = (on, why)."""
    from models.tiled.offload import decide, for_pipeline
    from toolkit.distributed.topology import config_batch

    tokens = config_batch(cfg, topo.dp).mbs * seq_len // topo.sp
    device = next(module.parameters()).device.type
    module.dstk_offload_activations = decide(mode, spec.config, tokens, topo.pp, param_dtype(cfg).itemsize,
                                             checkpoint_interval(cfg) > 0, device)
    for_pipeline(module.dstk_offload_activations[0])


def _tp_plan(config, task: str, cfg: dict, tp: int):
    """AutoTP's layer specs for sharding the stages (toolkit.distributed.tensor_parallel.partition_plan)."""
    from toolkit.distributed.tensor_parallel import partition_plan

    return partition_plan(config, _skeleton(config, task), cfg.get("tensor_parallel") or {}, tp)


def _check_every_stage_trains(record: dict, spec) -> None:
    """With LoRA a stage of only frozen layers (the embedding alone, or the norm and head) has nothing
    to train, and DeepSpeed cannot build an optimizer over no parameters: refused, on every rank alike."""
    parts = record["parts"]
    for stage in range(len(parts) - 1):
        layers = range(parts[stage], parts[stage + 1])
        if not any(is_adapter(name) for i in layers for name in record["hf_names"][i].values()):
            kinds = ", ".join(spec.kinds[i] for i in layers)
            raise ConfigError(f"--lora with parts {parts}: pipeline stage {stage} holds layers {layers.start}-"
                              f"{layers.stop - 1} ({kinds}) and no adapters, so it has nothing to train; give every "
                              "stage a block: fewer stages, partition_method \"compute\", or pipeline.parts "
                              "(`dstk partition MODEL --pp N --lora R --config FILE`)")


def _skeleton_for_lora(config, task: str):
    """The run's model on the meta device, where peft's LoraConfig finds its targets."""
    if config is None:
        raise ValueError("pipeline_module(lora=...) needs the run's HF config")
    return _skeleton(config, task)


def _skeleton(config, task: str, adapters=None):
    """The model of `config` on the meta device (its structure and names, no memory, no weights);
    wrapped by get_peft_model with `adapters` (peft's LoraConfig) when given."""
    import torch

    import models

    with torch.device("meta"):
        skeleton = models.auto_class(task).from_config(config)
        return wrap(skeleton, adapters) if adapters is not None else skeleton


def checkpoint_interval(cfg: dict) -> int:
    """pipeline.activation_checkpoint_interval (0: off): layers per checkpointed segment. The engine
    reads it from the config too; given to the module as it is built, so both agree from the start."""
    return int((cfg.get("pipeline") or {}).get("activation_checkpoint_interval") or 0)


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _check_labels(path: str, saved, wanted) -> None:
    """The directory's config decides the classifier's shape: it must have the data's label count."""
    if getattr(wanted, "num_labels", None) != getattr(saved, "num_labels", None):
        raise ConfigError(f"{path}/config.json has num_labels {saved.num_labels} but the data has "
                          f"{wanted.num_labels} labels (0..{wanted.num_labels - 1}); set \"num_labels\": "
                          f"{wanted.num_labels} (and id2label) in config.json, or use pp 1")


def choose_parts(spec, pp: int, cfg: dict, seq_len: int = 128) -> tuple[list, str | None]:
    """(parts, fallback): the config's pipeline.parts, else dstk's split by pipeline.partition_method.

    fallback is None, or (when dstk's cost model does not describe this layer list) a sentence
    saying which method was asked for, why it could not be used, and that parameter counts were
    balanced instead; the caller shows it (pipeline_module: a warning on rank 0)."""
    from toolkit.plan.cost import partition

    section = cfg.get("pipeline") or {}
    if section.get("parts"):
        return list(section["parts"]), None
    method = section.get("partition_method") or "compute"  # null reads as absent, as in DeepSpeed
    if method == "profile":  # toolkit.config.rules refuses this before launch; a caller may skip the rules
        raise ConfigError(PROFILE_NEEDS_PARTS)
    if method == "parameters":
        return partition.partition_balanced(spec.param_counts, pp), None
    if method == "uniform":
        return partition.partition_uniform(spec.num_layers, pp), None
    costs, reason = _costs(spec, cfg, seq_len)
    if costs is None:
        parts = partition.partition_balanced(spec.param_counts, pp)
        return parts, (f"pipeline.partition_method {method!r} needs dstk's per-layer cost model, which does not fit "
                       f"model_type {spec.config.model_type!r} ({reason}); split by parameter counts instead "
                       f"(DeepSpeed's 'parameters'): parts {parts}. To choose the split, record pipeline.parts "
                       "(`dstk partition MODEL --pp N --config FILE`) or set partition_method 'parameters' or 'uniform'")
    return partition.partition_layers(costs, pp, method=method), None


def check_recorded_parts(cfg: dict, config_path, model: str, task: str) -> None:
    """pipeline.parts recorded for another model is refused before launch: its last boundary must be
    this model's pipeline layer count (embedding, blocks, norm, head), counted from config.json alone."""
    from models.pipeline import check_parts
    from toolkit.plan.arch import load_arch

    section = cfg.get("pipeline") or {}
    parts, pp = section.get("parts"), section.get("stages")
    if not parts or not isinstance(pp, int) or pp < 2 or task != "causal-lm":
        return
    try:
        layers = load_arch(model).num_pipeline_layers
    except ConfigError:  # a structure the planner does not read: the build checks the parts itself
        return
    try:
        check_parts(parts, pp, layers)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: pipeline.parts {list(parts)} does not fit --model {model}, which has "
                          f"{layers} pipeline layers ({exc}): it was recorded for another model; record this "
                          f"model's split with `dstk partition {model} --pp {pp} --config {config_path}`") from None


PROFILE_NEEDS_PARTS = ('pipeline.partition_method "profile" is not measured at train time: every rank must build the '
                       'same stages, and timing each layer would build the whole model on one rank. Time the layers '
                       'once with `dstk partition MODEL --pp N --method profile --config FILE`, which records '
                       'pipeline.parts in FILE, or use "compute"')


def _costs(spec, cfg: dict, seq_len: int) -> tuple[list | None, str | None]:
    """(toolkit.plan.cost.layers per layer for rows of seq_len tokens, None) when its layer list matches the
    spec's, else (None, why not)."""
    from toolkit.plan.arch import arch_from_config
    from toolkit.plan.cost.layers import layer_costs

    try:
        arch = arch_from_config(spec.config.to_dict(), name=spec.config.model_type)
        costs = layer_costs(arch, seq_len=seq_len, mbs=cfg.get("train_micro_batch_size_per_gpu") or 1,
                            precision="bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp32")
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if len(costs) != spec.num_layers:
        return None, f"the cost model has {len(costs)} layers, the wrapped model {spec.num_layers}"
    return costs, None


def hf_name_map(spec, adapters=None) -> list:
    """Per layer, {key in that layer's state_dict: HF state-dict name}.

    The keys come from the same layer list built over a meta-device copy of the model (shapes only:
    no memory, no weights read), whose tensors ARE that copy's tensors; each layer may only map to
    names under its spec.hf_names entry. adapters (peft's LoraConfig): the copy is wrapped by
    get_peft_model first, and the names are the PeftModel's."""
    import models

    skeleton = _skeleton(spec.config, spec.task, adapters)
    by_id = {}
    for name, t in skeleton.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), name)  # a tied weight keeps its first name (the embedding's)
    prefix = PEFT_PREFIX if adapters is not None else ""
    meta_spec = models.pipeline_layers(skeleton.base_model.model if adapters is not None else skeleton, task=spec.task)
    names = []
    for layer, owned in zip(meta_spec.layers, spec.hf_names):
        built = layer.build() if hasattr(layer, "build") else layer
        found = {k: by_id[id(t)] for k, t in built.state_dict(keep_vars=True).items() if id(t) in by_id}
        bare = [hf.removeprefix(prefix) for hf in found.values()]
        stray = [hf for hf in bare if not any(hf == n or hf.startswith(n + ".") for n in owned)]
        if stray:
            raise ConfigError(f"layer {len(names)} holds {stray[:3]}, outside its HF modules {owned}")
        names.append(found)
    return names
