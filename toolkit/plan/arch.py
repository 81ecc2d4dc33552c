"""Transformer architectures as plain numbers: built-ins with published dimensions, or a local
HF directory's config.json read with `json` (no transformers import, so `dstk partition` is fast).

    arch = load_arch("llama-3.2-1b")           # a built-in
    arch = load_arch("path/to/hf_model")       # a directory holding config.json
    arch = load_arch("org/name")               # a hub id: its config.json in huggingface_hub's cache
    arch.num_params()                          # unique parameters (tied weights counted once)
    load_arch("mixtral-8x7b").active_params()  # of which one token's forward uses (top-k experts of E)

Mixture-of-experts configs (mixtral, olmoe, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3) are read with their
experts, shared experts and dense blocks (toolkit.plan.moe), DeepSeek's multi-head latent attention with its
low-rank projections (toolkit.plan.mla); other MoE families are refused, never counted as dense.

`to_hf_config(arch)` (imports transformers) builds the matching HF config; the tests build the
HF model from it on the meta device and check that `num_params()` equals the real count.
"""

import difflib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput
from toolkit.plan.mla import MLA_TYPES, mla_fields, mla_linears, mla_params
from toolkit.plan.moe import block_inactive_params, check_moe, moe_fields, moe_hf_kwargs, moe_params

# Model types whose MLP is a plain up -> act -> down (no gate) and whose norms are LayerNorm.
NON_GATED_TYPES = {"gpt2", "bert", "gpt_neox", "phi", "starcoder2", "gpt_bigcode", "falcon", "opt", "gptj"}
LAYERNORM_TYPES = NON_GATED_TYPES
# Attention details read per model type: RMSNorms on queries and keys ("head": over head_dim, Qwen3;
# "full": over the query and key widths, OLMoE), and attention_bias on the output projection too.
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}
O_BIAS_TYPES = {"llama", "qwen3", "qwen3_moe", "olmoe"} | MLA_TYPES  # MLA: on q_a, kv_a and o (toolkit.plan.mla)
MLP_BIAS_TYPES = {"deepseek_v2"}  # mlp_bias: biases on the dense MLP's and the shared experts' projections


@dataclass(frozen=True)
class Arch:
    """The dimensions the cost model needs. Derived fields are filled in `__post_init__`."""

    name: str
    model_type: str  # HF model_type: "gpt2", "bert", "llama", "qwen2", ...
    hidden: int  # h: width of the residual stream
    layers: int  # L: decoder (or encoder) blocks
    heads: int  # attention (query) heads
    intermediate: int  # I: MLP inner width
    vocab: int  # V
    max_positions: int  # longest sequence the model accepts
    kv_heads: int = 0  # key/value heads (GQA); 0 means = heads
    head_dim: int = 0  # 0 means hidden // heads
    tied: bool = False  # input embedding and LM head share one matrix
    norm: str = "rmsnorm"  # "rmsnorm" (weight only) or "layernorm" (weight + bias)
    gated_mlp: bool = True  # gate_proj * act(up_proj) -> down_proj (Llama) vs fc -> act -> proj
    qkv_bias: bool = False  # biases on the q, k, v projections (GPT-2, BERT, Qwen2)
    out_bias: bool = False  # biases on the attention output and MLP projections (GPT-2, BERT)
    learned_positions: bool = False  # a (max_positions, h) position table (GPT-2, BERT); else rotary
    type_vocab: int = 0  # BERT token-type embeddings
    attn_dropout: bool = False  # dropout on attention probabilities (GPT-2, BERT): one more saved copy
    act_fn: str = "silu"  # MLP activation (HF hidden_act / activation_function): sets saved activations
    qk_norm: str = ""  # "" none, "head" or "full": RMSNorms on q and k (QK_NORM)
    o_bias: bool = False  # a bias on the attention output projection alone (attention_bias: Llama, Qwen3, OLMoE)
    # Mixture of experts (toolkit.plan.moe); experts = 0 is a dense model.
    experts: int = 0  # E: routed experts in each MoE block
    experts_per_token: int = 0  # k: experts each token runs (num_experts_per_tok, top-k routing)
    expert_intermediate: int = 0  # I_e: one expert's MLP width
    shared_intermediate: int = 0  # I_s: the shared expert every token runs (Qwen2-MoE; DeepSeek: n_shared x I_e)
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(linear h -> 1) scales the shared expert's output
    dense_blocks: tuple = ()  # blocks of an MoE model with a dense MLP of width `intermediate`
    mlp_bias: bool = False  # biases on the gated MLP's projections and the shared expert's (DeepSeek-V2 mlp_bias)
    # Multi-head latent attention (toolkit.plan.mla); kv_lora_rank = 0 is ordinary attention. head_dim is then a
    # query/key head (qk_nope_head_dim + qk_rope_head_dim) and kv_heads = heads.
    kv_lora_rank: int = 0  # the key/value latent's width
    q_lora_rank: int = 0  # the query latent's width; 0: one q_proj h -> heads * head_dim
    qk_rope_dim: int = 0  # the rotary part of a query/key head (one rotary key shared by all heads)
    v_head_dim: int = 0  # a value head's width; 0 means = head_dim
    extra: dict = field(default_factory=dict, compare=False)  # config keys kept for to_hf_config

    def __post_init__(self):
        for key in ("hidden", "layers", "heads", "intermediate", "vocab", "max_positions"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"architecture {self.name!r}: {key} must be a positive integer, got {value!r}")
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.heads % self.kv_heads:
            raise ConfigError(f"architecture {self.name!r}: heads({self.heads}) is not a multiple of "
                              f"kv_heads({self.kv_heads})")
        if self.qk_norm not in ("", "head", "full"):
            raise ConfigError(f"architecture {self.name!r}: qk_norm {self.qk_norm!r} is not '', 'head' or 'full'")
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
        check_moe(self)

    @property
    def is_encoder(self) -> bool:
        """BERT-style: layer list [embeddings, L encoder layers, head] (no separate final norm)."""
        return self.model_type == "bert"

    @property
    def num_pipeline_layers(self) -> int:
        """Entries in the pipeline layer list: L+3 for causal LMs, L+2 for BERT."""
        return self.layers + (2 if self.is_encoder else 3)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek): low-rank q and kv projections (toolkit.plan.mla)."""
        return self.kv_lora_rank > 0

    def moe_block(self, index: int) -> bool:
        """Whether block `index` routes tokens to experts (else its MLP is dense)."""
        return self.is_moe and index not in self.dense_blocks

    def num_params(self) -> int:
        """Unique parameters of the HF model (tied matrices once), every expert included. Summed from the
        cost model."""
        return sum(held - tied for _, held, tied in layer_params(self))

    def inactive_params(self) -> int:
        """Parameters one token's forward does not use: the E - k experts of each MoE block it is not
        routed to (0 for a dense model)."""
        return sum(layer_inactive_params(self))

    def active_params(self) -> int:
        """Parameters one token's forward uses (MoE: the router's top-k experts of each block)."""
        return self.num_params() - self.inactive_params()


def _norm(arch: Arch) -> int:
    return (2 if arch.norm == "layernorm" else 1) * arch.hidden


def attention_linears(arch: Arch) -> list[tuple[int, int]]:
    """(in, out) features of one block's attention projections, unfused: q, k, v, o; or MLA's."""
    if arch.is_mla:
        return mla_linears(arch)
    h, qd, kd = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    return [(h, qd), (h, kd), (h, kd), (qd, h)]


def _attn_params(arch: Arch) -> int:
    if arch.is_mla:
        return mla_params(arch)
    h, qd, kd = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    qk_norm = {"": 0, "head": 2 * arch.head_dim, "full": h + h // arch.heads * arch.kv_heads}[arch.qk_norm]
    weights = sum(i * o for i, o in attention_linears(arch))
    return weights + arch.qkv_bias * (qd + 2 * kd) + (arch.out_bias or arch.o_bias) * h + qk_norm


def _block_params(arch: Arch, index: int) -> int:
    if arch.moe_block(index):
        return 2 * _norm(arch) + _attn_params(arch) + moe_params(arch)
    h, i = arch.hidden, arch.intermediate
    up = 2 if arch.gated_mlp else 1  # gate and up, or fc
    mlp = (up + 1) * h * i + (arch.out_bias or arch.mlp_bias) * (up * i + h)
    return 2 * _norm(arch) + _attn_params(arch) + mlp


def layer_params(arch: Arch) -> list[tuple[str, int, int]]:
    """(name, params held, of which copies) per pipeline layer, laid out as models/ builds them:
    a tied head is a TiedLayerSpec of the whole first layer, so its stage holds a full copy of it
    (DeepSpeed's `parameters` method counts it there too); BERT's first layer also owns the MLM
    transform and output bias, which the head uses. Unique parameters = sum(held - copies)."""
    h, v = arch.hidden, arch.vocab
    embed = v * h + arch.learned_positions * arch.max_positions * h
    if arch.is_encoder:  # token types and a LayerNorm inside BERT's embeddings
        embed += arch.type_vocab * h + _norm(arch)
    blocks = [(f"block.{i}", _block_params(arch, i), 0) for i in range(arch.layers)]
    if arch.is_encoder:  # MLM head: dense h->h, LayerNorm, decoder (tied to word embeddings) + bias V
        head_own = h * h + h + _norm(arch) + v
        if arch.tied:
            return [("embed", embed + head_own, 0)] + blocks + [("head", embed + head_own, embed + head_own)]
        return [("embed", embed, 0)] + blocks + [("head", head_own + v * h, 0)]
    head = ("head", embed, embed) if arch.tied else ("head", v * h, 0)
    return [("embed", embed, 0)] + blocks + [("norm", _norm(arch), 0), head]


def layer_inactive_params(arch: Arch) -> list[int]:
    """Per pipeline layer (aligned with layer_params), the parameters one token's forward leaves unused: the
    E - k routed experts of an MoE block it is not sent to; 0 elsewhere. A stage's active parameters per token
    are its parameters less these (shared experts, dense blocks, attention, embedding and head all run)."""
    return [block_inactive_params(arch) if name.startswith("block.") and arch.moe_block(int(name[6:])) else 0
            for name, _, _ in layer_params(arch)]


def _gpt2(name, hidden, layers, heads):
    return Arch(name, "gpt2", hidden, layers, heads, 4 * hidden, 50257, 1024, tied=True, norm="layernorm",
                gated_mlp=False, qkv_bias=True, out_bias=True, learned_positions=True, act_fn="gelu_new",
                attn_dropout=True)


def _llama(name, model_type, hidden, layers, heads, kv_heads, intermediate, vocab, max_positions, **kw):
    return Arch(name, model_type, hidden, layers, heads, intermediate, vocab, max_positions, kv_heads=kv_heads, **kw)


def _bert(name, hidden, layers, heads, intermediate, vocab=30522):
    return Arch(name, "bert", hidden, layers, heads, intermediate, vocab, 512, tied=True, norm="layernorm",
                gated_mlp=False, qkv_bias=True, out_bias=True, learned_positions=True, type_vocab=2, act_fn="gelu",
                attn_dropout=True)


# Published dimensions (the models' config.json on the HF hub).
BUILTINS = {a.name: a for a in [
    _gpt2("gpt2", 768, 12, 12),
    _gpt2("gpt2-medium", 1024, 24, 16),
    _gpt2("gpt2-large", 1280, 36, 20),
    _gpt2("gpt2-xl", 1600, 48, 25),
    _llama("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 128256, 131072, head_dim=64, tied=True),
    _llama("llama-3.2-3b", "llama", 3072, 28, 24, 8, 8192, 128256, 131072, head_dim=128, tied=True),
    _llama("llama-3-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 8192),
    _llama("llama-2-7b", "llama", 4096, 32, 32, 32, 11008, 32000, 4096),
    _llama("mistral-7b", "mistral", 4096, 32, 32, 8, 14336, 32000, 32768),
    _llama("qwen2.5-0.5b", "qwen2", 896, 24, 14, 2, 4864, 151936, 32768, tied=True, qkv_bias=True),
    _llama("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, 131072, qkv_bias=True),
    _llama("mixtral-8x7b", "mixtral", 4096, 32, 32, 8, 14336, 32000, 32768, experts=8, experts_per_token=2,
           expert_intermediate=14336),
    _llama("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, 40960, head_dim=128, qk_norm="head",
           experts=128, experts_per_token=8, expert_intermediate=768),
    # MLA: query/key heads 128 + 64 (rotary) wide, values 128, latents 1536 (q) and 512 (kv); 3 dense blocks, then
    # 256 routed experts (8 per token) and 1 shared, all 2048 wide. Without its multi-token-prediction block
    # (toolkit.plan.moe).
    _llama("deepseek-v3", "deepseek_v3", 7168, 61, 128, 128, 18432, 129280, 163840, head_dim=192, v_head_dim=128,
           q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, experts=256, experts_per_token=8,
           expert_intermediate=2048, shared_intermediate=2048, dense_blocks=(0, 1, 2)),
    _bert("bert-base", 768, 12, 12, 3072),
    _bert("bert-large", 1024, 24, 16, 4096),
    # Tiny ones for tests: same code paths, seconds on a CPU.
    replace(_gpt2("tiny-gpt2", 64, 4, 4), vocab=512, max_positions=256),
    replace(_gpt2("small-gpt2", 128, 6, 4), vocab=512, max_positions=512),
    _llama("tiny-llama", "llama", 64, 4, 4, 2, 176, 512, 256),
    _llama("tiny-mixtral", "mixtral", 64, 4, 4, 2, 128, 512, 256, experts=4, experts_per_token=2,
           expert_intermediate=128),  # MoE: fused experts in memory, one tensor per expert on disk
    _bert("tiny-bert", 64, 4, 4, 128, vocab=512),
]}
ALIASES = {"gpt2-small": "gpt2", "bert-base-uncased": "bert-base", "bert-large-uncased": "bert-large",
           "llama-1b": "llama-3.2-1b", "llama-3b": "llama-3.2-3b", "llama-8b": "llama-3-8b",
           "llama-3.1-8b": "llama-3-8b", "mistral-7b-v0.1": "mistral-7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
           "deepseek-v3-base": "deepseek-v3"}


def is_builtin(name) -> bool:
    """Whether `name` is in the one registry of model names (every command reads it)."""
    return str(name).lower() in BUILTINS or str(name).lower() in ALIASES


def builtin_names() -> str:
    """The registry's names, for help texts and messages."""
    return ", ".join(BUILTINS)


def load_arch(name_or_path: str, revision: str = "main") -> Arch:
    """A built-in name (see BUILTINS, ALIASES), a local HF directory (or its config.json), or a hub id
    (org/name) at `revision`, whose config.json is read from huggingface_hub's cache (models.weights.hub)."""
    key = str(name_or_path).lower()
    if key in BUILTINS or key in ALIASES:
        return BUILTINS[ALIASES.get(key, key)]
    path = Path(name_or_path)
    if path.exists():
        config_file = path / "config.json" if path.is_dir() else path
        return arch_from_config(_read_json(config_file), name=path.name or str(path))
    from models.weights import hub

    if hub.is_hub_id(name_or_path):
        folder = hub.snapshot(str(name_or_path), revision, flag="model", files=hub.CONFIG_FILES)
        return arch_from_config(_read_json(Path(folder) / "config.json"), name=str(name_or_path))
    raise _unknown(str(name_or_path))


def _unknown(name: str) -> ConfigError:
    names = sorted(BUILTINS) + sorted(ALIASES)
    close = difflib.get_close_matches(name.lower().rsplit("/", 1)[-1], names, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    if "/" in name or name.startswith("."):
        return UnusableInput(f"model {name!r}: no such directory (nor a hub id, org/name).{hint} Built-ins: "
                             f"{', '.join(sorted(BUILTINS))}")
    return ConfigError(f"unknown model {name!r}: not a built-in architecture and no such directory.{hint} "
                       f"Built-ins: {', '.join(sorted(BUILTINS))}")


def _read_json(config_file: Path) -> dict:
    if not config_file.is_file():
        raise UnusableInput(f"{config_file}: no such file (a HF model directory holds config.json)")
    try:
        content = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnusableInput(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(content, dict):
        raise UnusableInput(f"{config_file} is a JSON {type(content).__name__}, not a HF model config (an object "
                            'with "model_type"); restore the model\'s config.json')
    return content


def arch_from_config(cfg: dict, name: str) -> Arch:
    """An Arch from a HF config.json dict: GPT-2 and BERT by their own keys, else the Llama-style keys."""
    model_type = cfg.get("model_type")
    if not model_type:
        raise ConfigError(f"{name}/config.json has no 'model_type'; is it a HF model directory?")

    def need(key):
        if cfg.get(key) is None:
            raise ConfigError(f"{name}/config.json (model_type {model_type!r}) has no {key!r}")
        return cfg[key]

    if model_type == "gpt2":
        h = need("n_embd")
        return Arch(name, "gpt2", h, need("n_layer"), need("n_head"), cfg.get("n_inner") or 4 * h, need("vocab_size"),
                    need("n_positions"), tied=cfg.get("tie_word_embeddings", True), norm="layernorm",
                    gated_mlp=False, qkv_bias=True, out_bias=True, learned_positions=True,
                    act_fn=cfg.get("activation_function", "gelu_new"), attn_dropout=cfg.get("attn_pdrop", 0.1) > 0,
                    extra=cfg)
    common = dict(hidden=need("hidden_size"), layers=need("num_hidden_layers"), heads=need("num_attention_heads"),
                  intermediate=need("intermediate_size"), vocab=need("vocab_size"),
                  max_positions=need("max_position_embeddings"), extra=cfg,
                  act_fn=cfg.get("hidden_act", "gelu" if model_type == "bert" else "silu"))
    if model_type == "bert":
        return Arch(name, "bert", tied=cfg.get("tie_word_embeddings", True), norm="layernorm", gated_mlp=False,
                    qkv_bias=True, out_bias=True, learned_positions=True, type_vocab=cfg.get("type_vocab_size", 2),
                    attn_dropout=cfg.get("attention_probs_dropout_prob", 0.1) > 0, **common)
    plain = model_type in NON_GATED_TYPES
    # MLA (DeepSeek) sets its own head widths: a config's head_dim there is the rotary part (DeepseekV2Config)
    heads = dict(kv_heads=cfg.get("num_key_value_heads") or 0, head_dim=cfg.get("head_dim") or 0)
    heads.update(mla_fields(cfg, model_type, name))
    return Arch(name, model_type, tied=bool(cfg.get("tie_word_embeddings", False)),
                norm="layernorm" if model_type in LAYERNORM_TYPES else "rmsnorm", gated_mlp=not plain,
                qkv_bias=plain or _qkv_bias(cfg, model_type), out_bias=plain,
                o_bias=model_type in O_BIAS_TYPES and bool(cfg.get("attention_bias")),
                mlp_bias=model_type in MLP_BIAS_TYPES and bool(cfg.get("mlp_bias")),
                qk_norm=QK_NORM.get(model_type, ""), attn_dropout=(cfg.get("attention_dropout") or 0) > 0,
                **moe_fields(cfg, model_type, name), **heads, **common)


def _qkv_bias(cfg: dict, model_type: str) -> bool:
    """Biases on q, k, v: Qwen2 always, Qwen2-MoE by its own qkv_bias key (default on), Mixtral never,
    the others by attention_bias."""
    if model_type == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    if model_type == "mixtral" or model_type in MLA_TYPES:  # MLA: attention_bias is o_bias's (toolkit.plan.mla)
        return False
    return bool(cfg.get("attention_bias", model_type == "qwen2"))


def to_hf_config(arch: Arch):
    """The transformers config of an Arch (imports transformers: seconds; opt-in, tests and profiling)."""
    import transformers

    if arch.extra:  # read from a directory: hand back exactly what config.json said
        kwargs = {k: v for k, v in arch.extra.items() if k != "model_type"}
        return transformers.AutoConfig.for_model(arch.model_type, **kwargs)
    if arch.model_type == "gpt2":
        return transformers.GPT2Config(n_embd=arch.hidden, n_layer=arch.layers, n_head=arch.heads,
                                       n_inner=arch.intermediate, vocab_size=arch.vocab,
                                       n_positions=arch.max_positions, tie_word_embeddings=arch.tied,
                                       bos_token_id=arch.vocab - 1, eos_token_id=arch.vocab - 1)  # GPT-2: 50256
    kwargs = dict(hidden_size=arch.hidden, num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                  intermediate_size=arch.intermediate, vocab_size=arch.vocab,
                  max_position_embeddings=arch.max_positions, tie_word_embeddings=arch.tied)
    if arch.model_type == "bert":
        return transformers.BertConfig(type_vocab_size=arch.type_vocab, **kwargs)
    if arch.model_type == "llama":
        kwargs["attention_bias"] = arch.qkv_bias
    if arch.model_type == "mixtral":  # its experts' width is intermediate_size
        kwargs.update(num_local_experts=arch.experts, num_experts_per_tok=arch.experts_per_token,
                      intermediate_size=arch.expert_intermediate)
    elif arch.model_type in ("qwen3_moe", "deepseek_v3"):
        kwargs.update(moe_hf_kwargs(arch))
    elif arch.is_moe:
        raise ConfigError(f"architecture {arch.name!r}: to_hf_config builds MoE models from a config.json "
                          f"(arch_from_config) or the fields of mixtral, qwen3_moe, deepseek_v3 only, not "
                          f"{arch.model_type!r}")
    if not arch.is_mla:  # MLA's head widths are its own keys (moe_hf_kwargs)
        kwargs["head_dim"] = arch.head_dim
    return transformers.AutoConfig.for_model(arch.model_type, num_key_value_heads=arch.kv_heads, **kwargs)


def build_hf_model(arch: Arch, device: str = "meta"):
    """The HF model (*ForCausalLM, or BertForMaskedLM) with random weights on `device`; "meta" allocates
    nothing. Imports torch and transformers: opt-in (tests, profiling, benchmarks)."""
    import torch
    import transformers

    config = to_hf_config(arch)
    with torch.device(device):
        if arch.model_type == "bert":
            return transformers.BertForMaskedLM(config)
        return transformers.AutoModelForCausalLM.from_config(config)
