"""HuggingFace models as DeepSpeed pipeline layer lists.

    import models
    spec = models.pipeline_layers("path/to/hf_dir")        # or a HF model, or a config
    layers, loss_fn = spec                                  # straight into PipelineModule
    module = models.build_pipeline_module(spec, num_stages=4, parts=[0, 5, 9, 13, 17])

`pipeline_layers(model_or_path_or_config, *, task=None, seq_len=None) -> PipelineSpec`
    model: a HF PreTrainedModel (modules shared, not copied), a local HF directory (safetensors,
    single or sharded: each LayerSpec, built on its owning stage only, reads its own tensors with
    safe_open) or a PretrainedConfig (random weights). task: "causal-lm" (default for decoders),
    "masked-lm" (default for bert) or "sequence-classification".
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

from models.api import AUTO_CLASSES, TASKS, auto_class, default_task, pipeline_layers
from models.pipeline import build_pipeline_module, check_parts, mark_grad_norm_owners
from models.spec import KINDS, PipelineSpec

__all__ = ["pipeline_layers", "build_pipeline_module", "check_parts", "mark_grad_norm_owners", "PipelineSpec", "KINDS", "TASKS",
           "AUTO_CLASSES", "auto_class", "default_task"]
