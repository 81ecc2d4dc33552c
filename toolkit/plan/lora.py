"""LoRA adapter counts of an architecture (no torch): which linear layers `dstk train --lora` adapts by
default and how many parameters that adds, per pipeline layer.

    lora_params(load_arch("llama-2-7b"), r=16)     # [0, 1249280, ..., 1249280, 0, 0]: per layer
    param_counts(load_arch("llama-2-7b"), lora=16) # (6778392576, 39976960): base + adapters, adapters

Each adapted linear W (in x out) gets lora_A (r x in) and lora_B (out x r): r*(in + out) parameters.
The defaults are models.lora.adapters': every linear inside the blocks and an MoE block's fused experts
(peft's ParamWrapper: E pairs, r*E*(in + out) per expert tensor); tests/unit/test_plan_lora.py and
tests/unit/test_plan_moe.py check the counts against what peft creates through that path.
"""

from toolkit.errors import ConfigError
from toolkit.plan.arch import Arch, attention_linears, layer_params

# Model types whose q, k, v projections are one fused linear (GPT-2's c_attn, GPT-NeoX's query_key_value),
# and whose gate and up projections are one (Phi-3's gate_up_proj): LoRA adapts the fused matrix once.
FUSED_QKV_TYPES = {"gpt2", "gpt_bigcode", "gpt_neox", "phi3"}
FUSED_GATE_UP_TYPES = {"phi3"}
# MoE types whose linears named as experts were before fusion (a dense block's gate_proj, up_proj, down_proj)
# peft 0.21 reads as those experts under transformers 5 (peft.utils.transformers_weight_conversion's patterns,
# of the types modelled here): it adapts the fused experts instead, gate_up_proj at rank 2 r, and leaves the
# linears frozen (models.lora.experts.as_peft_converts). qwen2_moe has no pattern there.
PEFT_EXPERT_NAMES_TYPES = {"mixtral", "olmoe", "qwen3_moe"}


def check_lora_rank(r) -> None:
    """Refuse a LoRA rank that is not a positive integer (the message names dstk's flag)."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"--lora must be a positive integer (the LoRA rank r), got {r!r}")


def block_linears(arch: Arch, moe: bool = False) -> list[tuple[int, int]]:
    """(in, out) features of each linear layer inside one block: the modules LoRA adapts by default
    (models.lora.adapters: every block linear). Fused projections are one linear each. An MoE block's
    router and experts are parameters, not nn.Linear modules (transformers' fused 3-D experts), so only
    its attention and shared expert (with Qwen2-MoE's h -> 1 gate) are linears (lora_params adds the experts).
    MLA (DeepSeek): its five low-rank projections (toolkit.plan.mla)."""
    h, i, qd, kd = arch.hidden, arch.intermediate, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    attn = [(h, qd + 2 * kd), (qd, h)] if arch.model_type in FUSED_QKV_TYPES else attention_linears(arch)
    if moe:
        s = arch.shared_intermediate
        return attn + ([(h, s), (h, s), (s, h)] if s else []) + ([(h, 1)] if arch.shared_gate else [])
    if not arch.gated_mlp:
        up = [(h, i)]
    else:
        up = [(h, 2 * i)] if arch.model_type in FUSED_GATE_UP_TYPES else [(h, i), (h, i)]
    return attn + up + [(i, h)]


def expert_adapters(arch: Arch, r: int, converted: bool) -> int:
    """LoRA parameters on one MoE block's fused experts: gate_up_proj (E, 2 I_e, h) and down_proj (E, h, I_e),
    each E pairs of rank r (gate_up_proj 2 r where peft converted the targets)."""
    h, i, e = arch.hidden, arch.expert_intermediate, arch.experts
    return (2 * r if converted else r) * e * (h + 2 * i) + r * e * (i + h)


def lora_params(arch: Arch, r: int) -> list[int]:
    """LoRA adapter parameters per pipeline layer (aligned with layer_params), rank r on the default
    targets: each adapted linear W (in x out) gets lora_A (r x in) and lora_B (out x r), r*(in+out).
    Every block linear and MoE block's experts are adapted; embeddings, norms and the LM head are not.
    BERT: peft matches the target "dense" by name, so the MLM head's transform (h x h) is adapted too; it
    is counted on the head (the layer that runs it). These are the only parameters that train."""
    check_lora_rank(r)
    dense, moe = (r * sum(a + b for a, b in block_linears(arch, m)) for m in (False, True))
    if arch.is_moe:  # dense blocks among MoE ones: gate/up/down_proj linears peft may take for expert names
        converted = arch.model_type in PEFT_EXPERT_NAMES_TYPES and bool(arch.dense_blocks)
        dense -= r * sum(a + b for a, b in block_linears(arch)[-3:]) if converted and arch.gated_mlp else 0
        moe += expert_adapters(arch, r, converted)
    head = r * 2 * arch.hidden if arch.is_encoder else 0
    return [(moe if arch.moe_block(int(name[6:])) else dense) if name.startswith("block.") else
            head if name == "head" else 0 for name, _, _ in layer_params(arch)]


def param_counts(arch: Arch, lora: int | None = None) -> tuple[int, int]:
    """(unique parameters the model holds, of which train): full fine-tuning trains all of them; LoRA of
    rank `lora` adds its adapters to the frozen base and trains only those."""
    if lora is None:
        return arch.num_params(), arch.num_params()
    adapters = sum(lora_params(arch, lora))
    return arch.num_params() + adapters, adapters
