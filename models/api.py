"""`pipeline_layers`: a HF model, a local HF directory or a config -> PipelineSpec."""

import os

from models.weights.source import DirSource, LiveSource
from models.spec import PipelineSpec
from models import TASKS, task_named
from toolkit.errors import ConfigError


def pipeline_layers(model_or_path_or_config, *, task=None, seq_len=None, attention=None, adapt=None,
                    dtype=None) -> PipelineSpec:
    """Wrap a model as a pipeline layer list.

    model_or_path_or_config: a HF PreTrainedModel (its modules are shared, not copied), a local
    HF directory (each LayerSpec loads only its own tensors when built), or a PretrainedConfig
    (a model with random weights is built from it).
    task: "causal-lm", "masked-lm" or "sequence-classification" (models.TASKS); inferred when None.
    seq_len: checked against the config's max_position_embeddings when given.
    attention: the attention implementation ("sdpa", "eager", ...) for a directory or a config
    (a live model keeps its own); None: transformers' default.
    adapt: for a directory, adapt(module, hf_name) -> module is applied to each HF module a stage reads
    (LoRA injection); a live model is adapted by its owner before it is wrapped.
    dtype: for a directory, the dtype of the parameters its stages load (None: fp32; a run passes the
    one DeepSpeed's bf16/fp16 mode casts them to, so none is held in fp32 first); buffers stay as built.
    """
    task = task_named(task) if task is not None else None
    source, config, task = _resolve(model_or_path_or_config, task, attention, adapt, dtype)
    if seq_len is not None and seq_len > getattr(config, "max_position_embeddings", seq_len):
        raise ConfigError(f"seq_len {seq_len} > max_position_embeddings {config.max_position_embeddings} "
                          f"of model_type {config.model_type!r}: use --seq-len <= {config.max_position_embeddings}")
    return _build(source, config, task)


def _build(source, config, task) -> PipelineSpec:
    from models.bert import build_bert
    from models.generic import build_generic
    from models.gpt2 import build_gpt2

    if config.model_type == "bert":
        if task not in ("masked-lm", "sequence-classification"):
            raise ConfigError(f"task {task!r} for bert: use 'masked-lm' or 'sequence-classification'")
        return build_bert(source, config, task)
    if task != "causal-lm":
        raise ConfigError(f"task {task!r} for model_type {config.model_type!r}: only 'causal-lm' is wrapped "
                          "for decoder models (bert supports 'masked-lm' and 'sequence-classification')")
    if config.model_type == "gpt2":
        return build_gpt2(source, config)
    return build_generic(source, config)


def _resolve(obj, task, attention=None, adapt=None, dtype=None):
    """(source, config, task) from a model, a directory or a config."""
    from torch import nn

    if isinstance(obj, nn.Module):
        config = getattr(obj, "config", None)
        if config is None:
            raise ConfigError(f"{type(obj).__name__} is not a HF PreTrainedModel (no .config)")
        return LiveSource(obj), config, task or _task_of_class(type(obj).__name__, config)
    if isinstance(obj, (str, os.PathLike)):
        return _resolve_dir(os.fspath(obj), task, attention, adapt, dtype)
    if hasattr(obj, "model_type"):  # a PretrainedConfig: random weights
        task = task or default_task(obj)
        if attention:
            obj._attn_implementation = attention
        import torch

        return LiveSource(auto_class(task, obj)._from_config(obj, dtype=torch.float32)), obj, task
    raise ConfigError(f"cannot wrap a {type(obj).__name__}: pass a HF model, a local HF directory or a config")


def _resolve_dir(path, task, attention=None, adapt=None, dtype=None):
    from transformers import AutoConfig

    from models.weights import hub
    from models.weights.source import check_model_folder

    if not os.path.isdir(path) and hub.is_hub_id(path):  # org/name: its folder in huggingface_hub's cache
        path = hub.snapshot(path, flag="model")
    check_model_folder(path, flag="model")
    config = AutoConfig.from_pretrained(path)
    if attention:
        config._attn_implementation = attention  # every stage runs the kernel the run chose
    task = task or default_task(config)
    return DirSource(path, auto_class(task, config), config, adapt, dtype), config, task


def auto_class(task, config=None):
    """The transformers Auto class for `task` (a word of models.TASKS, short names included:
    AutoModelForCausalLM, ...); with a config, the concrete model class for it (LlamaForCausalLM, ...),
    refused clearly when transformers has none."""
    import transformers

    task = task_named(task)
    auto = getattr(transformers, TASKS[task])
    if config is None:
        return auto
    try:
        return auto._model_mapping[type(config)]
    except KeyError:
        raise ConfigError(f"model_type {config.model_type!r} has no {TASKS[task]} class in transformers "
                          f"{transformers.__version__}: it cannot be wrapped for task {task!r}") from None


def _task_of_class(name, config):
    for marker, task in (("SequenceClassification", "sequence-classification"), ("MaskedLM", "masked-lm"),
                         ("CausalLM", "causal-lm"), ("LMHead", "causal-lm")):
        if marker in name:
            return task
    raise ConfigError(f"{name}: no task head recognised (want *ForCausalLM, *ForMaskedLM or "
                      "*ForSequenceClassification); pass task=... and a model with that head")


def default_task(config):
    """bert -> masked-lm (sequence-classification when its architectures say so); else causal-lm."""
    archs = " ".join(getattr(config, "architectures", None) or [])
    if "SequenceClassification" in archs:
        return "sequence-classification"
    return "masked-lm" if config.model_type == "bert" else "causal-lm"


def check_router_aux(path, task: str = "causal-lm") -> None:
    """`dstk train --check` at pp > 1: the refusal a stage would raise building the layers of the model at `path` (a
    directory whose config turns output_router_logits on): its MoE router aux loss is
    one dstk carries between stages, or refused with the reason and the fix. On a meta-device skeleton (no weights)."""
    import torch
    from transformers import AutoConfig

    from models.moe import RouterAux

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        skeleton = auto_class(task, config)._from_config(config)
    RouterAux.of(skeleton, config)
