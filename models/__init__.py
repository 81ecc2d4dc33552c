"""HuggingFace models as DeepSpeed pipeline layer lists.

    import models
    spec = models.pipeline_layers("path/to/hf_dir")        # or a HF model, or a config
    layers, loss_fn = spec                                  # straight into PipelineModule
    module = models.build_pipeline_module(spec, num_stages=4, parts=[0, 5, 9, 13, 17])

`pipeline_layers(model_or_path_or_config, *, task=None, seq_len=None) -> PipelineSpec`
    model: a HF PreTrainedModel (modules shared, not copied), a local HF directory (safetensors,
    single or sharded: each LayerSpec, built on its owning stage only, reads its own tensors with
    safe_open) or a PretrainedConfig (random weights). task: a word of TASKS (below), "causal-lm"
    (default for decoders), "masked-lm" (default for bert) or "sequence-classification".
`PipelineSpec`: .layers (nn.Module / LayerSpec / TiedLayerSpec), .loss_fn(outputs, labels),
    .num_layers, .kinds (per layer "embed" | "block" | "norm" | "head"), .tied ({"embed": [0, n-1]}
    when input and output embeddings are tied), .param_counts (per layer, no layer built),
    .hf_names (per layer, the HF module/parameter names it holds), .config, .task.
`build_pipeline_module(spec, *, num_stages=None, topology=None, parts=None,
    partition_method="parameters", **kw) -> deepspeed.pipe.PipelineModule`
    parts (len num_stages + 1, 0 first, num_layers last) are used exactly, on every rank.
    Its parameters are marked so that DeepSpeed's gradient clipping norm counts every stage once,
    and activation checkpointing (activation_checkpoint_interval) wraps blocks and the final norm,
    never the embedding (see models/pipeline.py).

Layer lists:
    causal LMs (a config with base_model_pp_plan, or the standard structure read from the module tree:
    models/discover.py; and GPT-2): [embed, L blocks, final norm, head]
    BERT: [embeddings, L encoder layers, head] (MLM head tied to the word embeddings, or
    pooler + classifier for sequence classification).
Tied input/output embeddings use TiedLayerSpec key "embed" (tied_weight_attr "parts.0.weight",
BERT "embeddings.word_embeddings.weight"): with the head on another stage, that stage keeps a copy
of the whole tied module and DeepSpeed all-reduces only the shared matrix's gradient. The rest of
that copy is unused there (GPT-2's wpe on the head stage; BERT's position/type embeddings on the
head stage and its MLM transform + bias on the first stage), as in Megatron-DeepSpeed: export
takes embedding parts from the first stage and head parts from the last.

Data, as the pipeline iterator yields it (fixed shapes across batches):
    inputs = (input_ids, attention_mask[, token_type_ids]), (B, T) int64 each;
    labels = (B, T) int64 with -100 ignored (causal LM: shifted inside loss_fn, as HF), or (B,).
Between stages only (hidden (B, T, H) float, attention_mask (B, T) int64) travels; each block
rebuilds its mask with HF's mask functions (causal, sliding window, padding) and recomputes rotary
cos/sin, so results match HF under eager, sdpa or flex attention.
"""

from toolkit.errors import ConfigError

# The one table of tasks: each task's word and the transformers Auto class of its head. Every room reads
# it (the wrappers, training, data, export, parity, the commands' --task choices); it lives here, where
# nothing imports torch, so a command's --help can list the words.
TASKS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
         "sequence-classification": "AutoModelForSequenceClassification"}
# Other spellings read on input: `dstk train --task classification`, and the "task" that runs started with
# it recorded in their checkpoints.
SHORT_NAMES = {"classification": "sequence-classification"}

__all__ = ["pipeline_layers", "build_pipeline_module", "check_parts", "mark_grad_norm_owners", "PipelineSpec", "KINDS", "TASKS",
           "SHORT_NAMES", "task_named", "spellings", "auto_class", "default_task"]


def task_named(word: str) -> str:
    """The task's word in TASKS for `word` (a word of TASKS or of SHORT_NAMES); refused clearly when unknown."""
    task = SHORT_NAMES.get(word, word)
    if task not in TASKS:
        raise ConfigError(f"task {word!r} unknown: use one of {', '.join(TASKS)}")
    return task


def spellings(tasks) -> list:
    """The words a --task option accepts for `tasks` (words of TASKS): each, and its short names."""
    return [*tasks, *(short for short, task in SHORT_NAMES.items() if task in tasks)]


def __getattr__(name):
    """The rest on first use (PEP 562): they import torch, and `import models` alone (for TASKS) must not."""
    if name in ("pipeline_layers", "auto_class", "default_task"):
        from models import api

        return getattr(api, name)
    if name in ("build_pipeline_module", "check_parts", "mark_grad_norm_owners"):
        from models import pipeline

        return getattr(pipeline, name)
    if name in ("PipelineSpec", "KINDS"):
        from models import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
