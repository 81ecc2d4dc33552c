"""Multi-head latent attention (MLA: DeepSeek-V2 and V3) as plain numbers (no torch): what its
projections hold, compute and keep for backward.

MLA replaces the q, k, v projections by low-rank ones through two latents, each RMS-normalised:

    q:   h -> q_lora_rank (q_a_proj), RMSNorm, -> a * (nope + rope) (q_b_proj)
         (q_lora_rank null: one q_proj h -> a * (nope + rope), as DeepSeek-V2-Lite)
    kv:  h -> kv_lora_rank + rope (kv_a_proj_with_mqa: the latent and one rotary key shared by all heads),
         RMSNorm over the latent, -> a * (nope + v) (kv_b_proj: every head's key (nope part) and value)
    out: a * v -> h (o_proj)

with a = num_attention_heads, nope = qk_nope_head_dim, rope = qk_rope_head_dim, v = v_head_dim; a query
or key head is nope + rope wide (Arch.head_dim), a value head v. attention_bias puts biases on q_a_proj,
kv_a_proj_with_mqa and o_proj (the modules transformers builds with bias=config.attention_bias).

    mla_fields(cfg, "deepseek_v3")   # Arch keyword arguments from a config.json dict ({} for other types)
    mla_linears(arch)                # (in, out) of each projection, the order above
    mla_params(arch)                 # + biases + the two latent RMSNorms' weights

Per token, forward (a multiply-add counting 2): 2 * sum(in * out) over mla_linears; the scores and
P@V over the full T x T matrix, 2*T*a*(nope + rope) + 2*T*a*v (toolkit.plan.cost.layers).
"""

from toolkit.errors import ConfigError

MLA_TYPES = {"deepseek_v2", "deepseek_v3"}
# transformers' defaults for keys a config.json may leave out (DeepseekV2Config, DeepseekV3Config)
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128}


def mla_fields(cfg: dict, model_type: str, name: str) -> dict:
    """Arch keyword arguments of an MLA config: head_dim (a query/key head: nope + rope), v_head_dim,
    q_lora_rank (0: a plain q_proj), kv_lora_rank, qk_rope_dim; kv_heads = heads (every head has its own
    key and value out of kv_b_proj). {} for types without MLA."""
    if model_type not in MLA_TYPES:
        return {}
    get = {k: (cfg[k] if k in cfg else default) for k, default in DEFAULTS.items()}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(get[key], int) or isinstance(get[key], bool) or get[key] < 1:
            raise ConfigError(f"{name}/config.json: {key} must be a positive integer for {model_type}'s latent "
                              f"attention, got {get[key]!r}")
    q_rank = get["q_lora_rank"]
    if q_rank is not None and (not isinstance(q_rank, int) or isinstance(q_rank, bool) or q_rank < 1):
        raise ConfigError(f"{name}/config.json: q_lora_rank must be a positive integer or null (a plain q_proj), "
                          f"got {q_rank!r}")
    heads = cfg.get("num_attention_heads") or 0
    return dict(head_dim=get["qk_nope_head_dim"] + get["qk_rope_head_dim"], v_head_dim=get["v_head_dim"],
                q_lora_rank=q_rank or 0, kv_lora_rank=get["kv_lora_rank"], qk_rope_dim=get["qk_rope_head_dim"],
                kv_heads=heads)


def mla_linears(arch) -> list[tuple[int, int]]:
    """(in, out) features of MLA's projections: q_a and q_b (or q), kv_a (with the rotary key), kv_b, o."""
    h, a, qk, rope, r = arch.hidden, arch.heads, arch.head_dim, arch.qk_rope_dim, arch.kv_lora_rank
    nope = qk - rope
    q = [(h, arch.q_lora_rank), (arch.q_lora_rank, a * qk)] if arch.q_lora_rank else [(h, a * qk)]
    return q + [(h, r + rope), (r, a * (nope + arch.v_head_dim)), (a * arch.v_head_dim, h)]


def mla_params(arch) -> int:
    """Parameters of one MLA module: its projections, their biases (attention_bias: q_a, kv_a, o) and the
    RMSNorms over the two latents (q_a_layernorm, kv_a_layernorm)."""
    weights = sum(i * o for i, o in mla_linears(arch))
    norms = arch.q_lora_rank + arch.kv_lora_rank
    biases = arch.o_bias * (arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_dim + arch.hidden)
    return weights + norms + biases


def mla_score_width(arch) -> int:
    """Per head, the width the T x T matrices multiply: the scores over nope + rope, P@V over v."""
    return arch.head_dim + arch.v_head_dim


def mla_act_elements(arch) -> int:
    """Elements one token's MLA keeps for backward beyond the block's norms (as HF's DeepSeek attention saves
    them, measured with saved_tensors_hooks): the query latent, its RMSNorm's statistics, normalised and
    scaled copies (3 * q_lora_rank + 1); kv_a's output (kv_lora_rank + rope) and its latent's RMSNorm
    (2 * kv_lora_rank + 1); the assembled queries and keys (2 * a * (nope + rope)); the values and the
    attention output (2 * a * v). Rotary's cos and sin are per position, not per token: left out."""
    q = 3 * arch.q_lora_rank + 1 if arch.q_lora_rank else 0
    kv = arch.kv_lora_rank + arch.qk_rope_dim + 2 * arch.kv_lora_rank + 1
    return q + kv + 2 * arch.heads * (arch.head_dim + arch.v_head_dim)
