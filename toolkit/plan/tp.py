"""Tensor parallelism with DeepSpeed's AutoTP (0.19): which architectures it can shard, and what one
rank of a tp group holds, computes and sends.

    autotp_problems(load_arch("gpt2"), tp=2)          # ["gpt2 has no AutoTP plan: ..."]
    shard_layers(arch, costs, seq, "bf16", tp=2)      # per-rank params, FLOPs, activations per layer
    shard_layers(arch, costs, seq, "bf16", tp=2, pipeline=True)   # tp inside pipeline stages (3D)
    tp_comm_bytes(arch, seq, mbs=1, precision="bf16", tp=2, checkpointing=False)

Where AutoTP gets its plan (deepspeed/runtime/engine.py:1029): "partition_config" or "preset_model" in
the config first, then the HF model's tp plan (config.base_model_tp_plan merged with the model's
_tp_plan, runtime/tensor_parallel/config.py _get_hf_tp_plan), then a heuristic (AutoTP.tp_parser) that
refuses gpt2 outright and BERT/OPT in practice ("AutoTP not supported for model",
module_inject/auto_tp.py:349). dstk accepts a model only with a plan: HF_PLAN_TYPES (read from
transformers 5.17 on, checked by tests/unit/test_tp_config.py), or a "preset_model" / "partition_config".

What a rank holds, as measured on Llama at tp = 2 (/tmp/tp/REPORT.md section 1): q/k/v/gate/up split by
rows (column-parallel), o/down by columns (row-parallel, their biases replicated); norms replicated; an
untied lm_head column-parallel with its logits gathered; an untied embedding replicated; a tied
embedding and head vocab-parallel (one V/tp shard, logits and loss sharded). Activations inside
attention and the MLP shard with their heads and columns; the norms' inputs and outputs (the residual
stream) are replicated, as in Megatron without sequence parallelism. Communication (Megatron's f/g
operators): per block two all-reduces of the (mbs, seq, h) activations forward and two backward, two
more forward with activation checkpointing (the recompute); the head: untied, an all-gather of the
logits forward and an all-reduce of the input gradient backward; tied (vocab-parallel), an all-reduce
after the embedding and one of the head's input gradient. The loss's own reductions (a few floats per
token) are not counted.

Inside pipeline stages (3D, dp x pp x tp; dstk train's toolkit.distributed.tensor_parallel): each stage's decoder
blocks are sharded as above by the stage's tp group, but the embedding, the final norm and the head stay
whole on every tp rank (a tied embedding stays a pipeline tied layer), so those layers keep their
unsharded figures and their collectives vanish (`pipeline=True`).
"""

import functools
import importlib.metadata
import re

from toolkit.plan.arch import Arch
from toolkit.plan.memory.precision import weight_bytes

# Model types whose transformers config class has a base_model_tp_plan (a subset: the families dstk's arch
# reader knows), from transformers 5.17 (setup.cfg's floor) on unless PLAN_SINCE names a later release;
# tests check each against the installed transformers.
HF_PLAN_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "gpt_neox", "gptj", "phi", "phi3", "olmo", "olmo2", "olmoe", "starcoder2", "cohere", "glm", "granite",
    "deepseek_v2", "deepseek_v3", "helium", "smollm3", "ministral"})
PLAN_SINCE = {"gptj": (5, 24)}  # (major, minor) of the transformers release that gave it its plan
# "preset_model" values (module_inject/autotp_config.py:561-567); used only when the config names one.
DEEPSPEED_PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")


def has_hf_plan(model_type: str) -> bool:
    """Does the installed transformers give `model_type` a base_model_tp_plan? Its version is read from the
    package's metadata (no transformers import: `dstk validate` starts fast)."""
    if model_type not in HF_PLAN_TYPES:
        return False
    return model_type not in PLAN_SINCE or _transformers_version() >= PLAN_SINCE[model_type]


@functools.cache
def _transformers_version() -> tuple:
    """(major, minor) of the installed transformers; (0, 0) where it is not installed."""
    try:
        release = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    return tuple(int(re.match(r"\d+", part).group()) for part in release.split(".")[:2])


def autotp_problems(arch: Arch, tp: int, custom_plan: bool = False) -> list[str]:
    """Why `arch` cannot be sharded `tp` ways by AutoTP (empty when it can). custom_plan: the config
    names a "preset_model" or "partition_config", so the HF plan is not needed."""
    return shard_problems(arch.name, arch.model_type, has_hf_plan(arch.model_type), tp, custom_plan,
                          {"num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
                           "intermediate_size": arch.intermediate})


def shard_problems(name: str, model_type: str, has_plan: bool, tp: int, custom_plan: bool, sizes: dict) -> list[str]:
    """The one AutoTP rule, for dstk's architecture table (autotp_problems: `dstk validate --model`, plan)
    and for a HF config at train time (toolkit.train.hf.check_tensor_parallel): a plan (the HF config's
    base_model_tp_plan, or a preset_model / partition_config), and heads, key/value heads and the MLP's
    width (`sizes`, None where the model has none) that tp divides."""
    if tp <= 1:
        return []
    problems = []
    if not custom_plan and not has_plan:
        if model_type in DEEPSPEED_PRESETS:
            problems.append(f'{name} (model_type {model_type!r}) has no HF tp plan; DeepSpeed has a preset '
                            f'for it: add "preset_model": "{model_type}" to "tensor_parallel"')
        else:
            problems.append(f"{name} (model_type {model_type!r}) has no AutoTP plan: its HF config has no "
                            "base_model_tp_plan and DeepSpeed has no preset for it, so AutoTP falls back to a "
                            'heuristic that refuses it ("AutoTP not supported for model", '
                            "deepspeed/module_inject/auto_tp.py:349); train it with tp = 1 (dp or pp), or give "
                            '"tensor_parallel.partition_config" layer patterns')
    known = {k: v for k, v in sizes.items() if isinstance(v, int) and v > 0}
    for what, value in known.items():
        if value % tp:
            fits = ", ".join(str(d) for d in range(2, 65) if all(v % d == 0 for v in known.values())) or "none above 1"
            problems.append(f"tp {tp} does not divide {name}'s {what} ({value}): each rank of a tp group must "
                            f"hold whole heads and an equal slice of the MLP; use a tp that divides the heads, the "
                            f"key/value heads and the intermediate size ({fits})")
    return problems


def tp_candidates(arch: Arch, gpus_per_node: int, lora: int | None = None) -> list[int]:
    """tp sizes `dstk plan` tries: divisors of the GPUs in one node (a tp group's all-reduces stay on
    the node's links), that AutoTP can shard the model by with its HF plan. Dense models without LoRA
    only: AutoTP of experts, of latent attention (MLA) and of LoRA adapters is not modelled."""
    if lora is not None or arch.is_moe or arch.is_mla or not has_hf_plan(arch.model_type):
        return [1]
    # tp divides the heads, so at most heads of them (bounds the search whatever --gpus-per-node says)
    return [t for t in range(1, min(gpus_per_node, arch.heads) + 1)
            if gpus_per_node % t == 0 and not autotp_problems(arch, t)]


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _block_replicated(arch: Arch) -> int:
    """Parameters of a block every tp rank keeps whole: norms (and q/k norms), and the biases of the
    row-parallel o_proj and down_proj, added after their all-reduce."""
    norm = (2 if arch.norm == "layernorm" else 1) * arch.hidden
    qk_norm = {"": 0, "head": 2 * arch.head_dim, "full": arch.hidden + arch.hidden // arch.heads * arch.kv_heads}
    return 2 * norm + qk_norm[arch.qk_norm] + (arch.out_bias or arch.o_bias) * arch.hidden + arch.out_bias * arch.hidden


def shard_layers(arch: Arch, costs: list, seq: int, precision: str, tp: int, pipeline: bool = False) -> dict:
    """Per-layer figures of one tp rank, from the unsharded LayerCosts of one sequence (toolkit.plan.cost.layers):
    {"params", "tied", "flops", "fwd_flops", "act", "peak"}, each a list over the pipeline layers. FLOPs of
    blocks and the head divide by tp (their matmuls and attention split; the elementwise rest is small);
    the embedding lookup and the final norm are replicated. pipeline: tp inside pipeline stages, where
    only the blocks are sharded (the embedding, final norm and head keep their whole figures)."""
    e, n, h, v = weight_bytes(precision), seq, arch.hidden, arch.vocab
    k = 2 if arch.norm == "layernorm" else 3  # saved norm tensors per token (cost/layers.py _act_bytes)
    out = {key: [] for key in ("params", "tied", "flops", "fwd_flops", "act", "peak")}
    vocab_parallel = arch.tied  # transformers 5 plans a tied embedding embedding_rowwise
    for c in costs:
        if c.kind == "block":
            rep = _block_replicated(arch)
            params, act_rep = rep + _ceil(c.params - rep, tp), e * n * 2 * k * h
            act, flops, fwd = act_rep + _ceil(c.act_bytes - act_rep, tp), c.flops / tp, c.fwd_flops / tp
        elif pipeline or c.kind == "norm":  # whole on every tp rank (a final norm always; all ends in 3D)
            params, act, flops, fwd = c.params, c.act_bytes, c.flops, c.fwd_flops
        elif c.kind == "embed":
            params = c.params - v * h + _ceil(v * h, tp) if vocab_parallel else c.params
            act, flops, fwd = c.act_bytes, c.flops, c.fwd_flops
        elif c.kind == "head":
            params = out["params"][0] if arch.tied else c.params - v * h + _ceil(v * h, tp)
            # whole on every rank: AutoTP's training lm_head gathers its output (module_inject/auto_tp.py:
            # LinearLayer(gather_output=True)), so the logits, the loss and its peak are the unsharded ones
            act, flops, fwd = c.act_bytes, c.flops / tp, c.fwd_flops / tp
        else:
            raise ValueError(f"layer {c.name!r}: unknown kind {c.kind!r}")
        for key, value in (("params", params), ("tied", params if c.tied_params else 0), ("flops", flops),
                           ("fwd_flops", fwd), ("act", act), ("peak", c.peak_bytes)):
            out[key].append(value)
    return out


def tp_comm_bytes(arch: Arch, seq: int, mbs: int, precision: str, tp: int, checkpointing: bool = False,
                  pipeline: bool = False) -> float:
    """Bytes one rank sends over its tp group per micro-batch (ring collectives: an all-reduce of B bytes
    sends 2 (tp-1)/tp B, an all-gather (tp-1)/tp B). pipeline: tp inside pipeline stages, whose
    embedding and head are whole on every tp rank (no collectives of their own)."""
    if tp <= 1:
        return 0.0
    share, w = (tp - 1) / tp, weight_bytes(precision)
    hidden = mbs * seq * arch.hidden * w  # one (mbs, seq, h) activation
    per_block = (4 + 2 * checkpointing) * 2 * share * hidden
    if pipeline:  # a replicated embedding and head compute the same tensors on every tp rank
        ends = 0.0
    elif arch.tied:  # vocab-parallel: all-reduce after the embedding, and of the head's input gradient
        ends = 2 * 2 * share * hidden
    else:  # gather the logits, all-reduce the head's input gradient
        ends = share * mbs * seq * arch.vocab * w + 2 * share * hidden
    return arch.layers * per_block + ends
