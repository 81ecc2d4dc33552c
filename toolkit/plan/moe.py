"""Mixture-of-experts blocks as plain numbers (no torch): which HF configs have experts, what an MoE
block holds, and what it computes per token.

An MoE block keeps the dense block's attention and norms and replaces its MLP with a router (a linear
h -> E, no bias), E routed experts (gated MLPs of width I_e, stored by transformers as fused 3-D
parameters gate_up_proj (E, 2*I_e, h) and down_proj (E, h, I_e)) of which each token runs its top k,
and, in some families, shared experts every token runs.

    moe_fields(cfg, "mixtral", "x")    # Arch keyword arguments from a config.json dict ({} when dense)
    moe_params(arch)                   # parameters of one MoE block's MLP: router + all E experts + shared
    moe_flops(arch, n)                 # forward FLOPs of that MLP for n tokens: router + k experts + shared

Modelled exactly (parameter counts equal the HF model's on the meta device: tests/unit/test_plan_moe.py):
  mixtral    num_local_experts (E), num_experts_per_tok (k), experts of width intermediate_size
  olmoe      num_experts, num_experts_per_tok, experts of width intermediate_size; attention with
             q_norm over hidden_size and k_norm over the key width (Arch.qk_norm "full")
  qwen3_moe  num_experts (or num_local_experts), moe_intermediate_size; q_norm and k_norm over head_dim;
             dense blocks (an MLP of width intermediate_size) at mlp_only_layers and wherever
             (i + 1) % decoder_sparse_step != 0
  qwen2_moe  as qwen3_moe without the q/k norms, plus a shared expert of width
             shared_expert_intermediate_size with its sigmoid gate (a linear h -> 1)
  deepseek_v2, deepseek_v3
             n_routed_experts (E) of width moe_intermediate_size, num_experts_per_tok (k); n_shared_experts
             shared experts, held as one gated MLP of width moe_intermediate_size * n_shared_experts, without
             a gate; the first first_k_dense_replace blocks dense (an MLP of width intermediate_size); the
             router's weight E x h (V3 also keeps e_score_correction_bias, E floats, as a buffer: no parameter,
             not trained; transformers keeps it and the router's weight in fp32, a few MB a block, not
             counted); multi-head latent attention (toolkit.plan.mla); V2's mlp_bias on the dense MLP and
             the shared experts. The multi-token-prediction block of DeepSeek-V3's checkpoint
             (model.layers.61, num_nextn_predict_layers) is not counted: transformers does not load it.
Every other config with routed experts is refused (dbrx, jamba, gpt_oss, llama4, ...): counting it as a
dense model would be wrong by the experts.

Per token, forward, a multiply-add counting 2 (n tokens: multiply by n):
  router    2*h*E
  experts   k * 3 * 2*h*I_e            the top-k experts a token is routed to, not all E
  shared    3 * 2*h*I_s (+ 2*h)        the shared expert (qwen2_moe: and its gate)
Memory: moe_params counts all E experts, as every rank holds them without expert parallelism (with AutoEP's
ep > 1 a rank holds E / ep: toolkit.plan.memory.rank.expert_states); FLOPs and activations count k.

Approximated:
  - every token runs exactly k experts and each expert's rows cost what a dense matmul of that many
    rows costs: HF's routers are top-k without a capacity factor (no token is dropped), so the FLOPs
    are exact, but time is not: load imbalance and small per-expert batches (grouped GEMMs over few
    rows) run below the dense rate, which the planner's mfu does not see;
  - elementwise work (softmax and top-k over E logits, the activation, the routing weights) is rough;
  - activations follow HF's eager expert loop (see moe_act_bytes); "grouped_mm", transformers' default,
    keeps about the same tensors (the k*n routed rows, their 2*I_e and I_e intermediates).
"""

from toolkit.errors import ConfigError

# Families counted exactly, with transformers' defaults for keys a config.json may leave out.
DEFAULTS = {
    "mixtral": {"experts": 8, "k": 2},
    "olmoe": {"experts": 64, "k": 8},
    "qwen2_moe": {"experts": 60, "k": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"experts": 128, "k": 8, "moe_intermediate_size": 768},
    "deepseek_v2": {"experts": 64, "k": None, "moe_intermediate_size": 1407, "n_shared_experts": 2,
                    "first_k_dense_replace": 0},
    "deepseek_v3": {"experts": 256, "k": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                    "first_k_dense_replace": 3},
}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
REFUSAL_REASONS = {
    "gpt_oss": "its experts carry biases, its attention sinks and alternating sliding-window layers are not what "
               "dstk counts (nor can it run sdpa attention)",
}


def expert_count(cfg: dict) -> int:
    """Routed experts a config.json declares under any family's key (dbrx: ffn_config), 0 if none."""
    for key in EXPERT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    ffn = cfg.get("ffn_config")
    return (ffn.get("moe_num_experts") or 0) if isinstance(ffn, dict) else 0


def moe_fields(cfg: dict, model_type: str, name: str) -> dict:
    """Arch keyword arguments of an MoE config (experts, experts_per_token, expert_intermediate,
    shared_intermediate, shared_gate, dense_blocks); {} for a dense one. Refuses MoE families not
    modelled exactly, rather than counting them as dense."""
    if model_type not in DEFAULTS:
        if expert_count(cfg) or "moe" in model_type:
            raise ConfigError(_refusal(cfg, model_type, name))
        return {}
    defaults = DEFAULTS[model_type]
    if model_type.startswith("deepseek"):
        return _deepseek_fields(cfg, defaults, cfg.get("num_hidden_layers") or 0)
    experts = next((cfg[k] for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None),
                   defaults["experts"])
    k = cfg.get("num_experts_per_tok") or defaults["k"]
    layers = cfg.get("num_hidden_layers") or 0
    if model_type in ("mixtral", "olmoe"):  # every block is MoE; the experts' width is intermediate_size
        return dict(experts=experts, experts_per_token=k, expert_intermediate=cfg.get("intermediate_size") or 0)
    fields = dict(experts=experts, experts_per_token=k,
                  expert_intermediate=cfg.get("moe_intermediate_size") or defaults["moe_intermediate_size"],
                  dense_blocks=_qwen_dense_blocks(cfg, experts, layers))
    if model_type == "qwen2_moe":
        shared = cfg.get("shared_expert_intermediate_size")
        fields.update(shared_intermediate=defaults["shared_expert_intermediate_size"] if shared is None else shared,
                      shared_gate=True)
    if not experts:  # num_experts 0: HF builds every block dense
        fields.update(experts=0, experts_per_token=0, expert_intermediate=0, shared_intermediate=0,
                      shared_gate=False, dense_blocks=())
    return fields


def _deepseek_fields(cfg: dict, defaults: dict, layers: int) -> dict:
    """DeepSeek-V2/V3: n_routed_experts (or an alias), n_shared_experts of moe_intermediate_size as one shared
    MLP without a gate, blocks before first_k_dense_replace dense."""
    experts = next((cfg[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if cfg.get(k)),
                   defaults["experts"])
    width = cfg.get("moe_intermediate_size") or defaults["moe_intermediate_size"]
    shared = cfg.get("n_shared_experts", defaults["n_shared_experts"]) or 0
    first_dense = cfg.get("first_k_dense_replace", defaults["first_k_dense_replace"]) or 0
    return dict(experts=experts, experts_per_token=cfg.get("num_experts_per_tok") or defaults["k"] or 0,
                expert_intermediate=width, shared_intermediate=width * shared,
                dense_blocks=tuple(range(min(first_dense, layers))))


def moe_hf_kwargs(arch) -> dict:
    """transformers config keys of a built-in Qwen3-MoE or DeepSeek-V3 Arch (toolkit.plan.arch.to_hf_config):
    its experts, dense blocks and (DeepSeek) latent attention."""
    if arch.model_type == "qwen3_moe":
        return dict(num_experts=arch.experts, num_experts_per_tok=arch.experts_per_token,
                    moe_intermediate_size=arch.expert_intermediate, mlp_only_layers=list(arch.dense_blocks),
                    attention_bias=arch.o_bias)
    if arch.dense_blocks != tuple(range(len(arch.dense_blocks))):
        raise ConfigError(f"architecture {arch.name!r}: DeepSeek's dense blocks come first (first_k_dense_replace), "
                          f"got {arch.dense_blocks}")
    return dict(n_routed_experts=arch.experts, num_experts_per_tok=arch.experts_per_token,
                moe_intermediate_size=arch.expert_intermediate,
                n_shared_experts=arch.shared_intermediate // arch.expert_intermediate,
                first_k_dense_replace=len(arch.dense_blocks), q_lora_rank=arch.q_lora_rank or None,
                kv_lora_rank=arch.kv_lora_rank, qk_rope_head_dim=arch.qk_rope_dim,
                qk_nope_head_dim=arch.head_dim - arch.qk_rope_dim, v_head_dim=arch.v_head_dim,
                attention_bias=arch.o_bias)


def _qwen_dense_blocks(cfg: dict, experts: int, layers: int) -> tuple:
    """Blocks Qwen2/3-MoE build with a dense MLP: in mlp_only_layers, or off the decoder_sparse_step grid."""
    step = cfg.get("decoder_sparse_step") or 1
    only = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(layers) if i in only or not (experts > 0 and (i + 1) % step == 0))


def _refusal(cfg: dict, model_type: str, name: str) -> str:
    experts = expert_count(cfg)
    why = REFUSAL_REASONS.get(model_type, "its experts' shapes and routing are not modelled")
    return (f"{name}/config.json: model_type {model_type!r} is a mixture-of-experts model"
            f"{f' ({experts} routed experts)' if experts else ''} and {why}; counting it as a dense model "
            f"would be wrong by the experts, so dstk refuses it. MoE families counted exactly: "
            f"{', '.join(sorted(DEFAULTS))}")


def check_moe(arch) -> None:
    """Refuse inconsistent MoE fields of an Arch (message names the fields and the numbers)."""
    if not arch.experts:
        if arch.experts_per_token or arch.expert_intermediate or arch.shared_intermediate or arch.dense_blocks:
            raise ConfigError(f"architecture {arch.name!r}: expert fields set but experts is 0")
        return
    if not 1 <= arch.experts_per_token <= arch.experts:
        raise ConfigError(f"architecture {arch.name!r}: experts_per_token (num_experts_per_tok) must be in "
                          f"[1, experts({arch.experts})], got {arch.experts_per_token}")
    if arch.expert_intermediate < 1:
        raise ConfigError(f"architecture {arch.name!r}: expert_intermediate must be a positive integer, "
                          f"got {arch.expert_intermediate}")
    bad = [i for i in arch.dense_blocks if not 0 <= i < arch.layers]
    if bad:
        raise ConfigError(f"architecture {arch.name!r}: dense_blocks {bad} are outside blocks 0..{arch.layers - 1}")


def moe_params(arch) -> int:
    """Parameters of one MoE block's MLP: router E x h, all E experts (gate, up, down: 3*h*I_e each),
    the shared expert (3*h*I_s; with mlp_bias + 2*I_s + h) and its gate (h). Routed experts and routers
    have no bias in the modelled families."""
    h, shared = arch.hidden, arch.shared_intermediate
    return (arch.experts * h + arch.experts * 3 * h * arch.expert_intermediate
            + 3 * h * shared + (arch.mlp_bias and shared > 0) * (2 * shared + h) + arch.shared_gate * h)


def block_inactive_params(arch) -> int:
    """Parameters of one MoE block a token does not use: the E - k experts it is not routed to."""
    return (arch.experts - arch.experts_per_token) * 3 * arch.hidden * arch.expert_intermediate


def moe_flops(arch, n: int) -> float:
    """Forward FLOPs of one MoE block's matmuls for n tokens: the router, k experts per token, the shared
    expert and its gate (module docstring)."""
    h = arch.hidden
    routed = arch.experts_per_token * 3 * 2 * n * h * arch.expert_intermediate
    return 2 * n * h * arch.experts + routed + 3 * 2 * n * h * arch.shared_intermediate + arch.shared_gate * 2 * n * h


def moe_elementwise_flops(arch, n: int) -> float:
    """Rough elementwise FLOPs: softmax and top-k over E logits, the activation and product of each routed
    row and the shared expert, the routing weights and the sum of k outputs."""
    width = arch.experts_per_token * arch.expert_intermediate + arch.shared_intermediate
    return 5 * n * arch.experts + 4 * n * width + 2 * n * arch.experts_per_token * arch.hidden


def moe_act_bytes(arch, n: int, e: int) -> int:
    """Bytes one MoE block's MLP keeps for backward for n tokens, e bytes per element, as HF's eager
    expert loop saves them. Per routed row (k*n of them): the gathered input (h), the gate_up output
    (2*I_e; gate and up are views of it), the activation and the product (2*I_e), the expert's output and
    its routing weight (h + 1), the scaled output index_add_ keeps (h: IndexAddBackward saves its source);
    int64 positions to scatter it back (3). Per token: the router's
    fp32 probabilities (E) and top-k indices (k); with a shared expert its gated MLP (4*I_s), and with its
    gate the gate's output and product (h + 1). The norm output the router reads is counted with the
    block's norms."""
    k, h, ie = arch.experts_per_token, arch.hidden, arch.expert_intermediate
    routed = k * n * (e * (3 * h + 4 * ie + 1) + 3 * 8)
    router = n * (4 * arch.experts + 8 * k)
    shared = e * n * (4 * arch.shared_intermediate + arch.shared_gate * (h + 1))
    return routed + router + shared
