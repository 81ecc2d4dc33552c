"""Tiny mixture-of-experts checkpoints as transformers' own save_pretrained writes them: one tensor per expert on
disk (`block_sparse_moe.experts.3.w1.weight`, `mlp.experts.3.gate_proj.weight`) where the model holds them fused,
gpt_oss's natively fused. The configs are bench/arch_sweep_config's tiny ones (every size shrunk, 2 layers of 4
experts, top-2; deepseek_v3: layer 0 dense, MLA and a shared expert; qwen2_moe: a shared expert; gpt_oss: a sliding
and a full layer, attention sinks), with the byte tokenizer's vocabulary (257 ids).

    folder = save_tiny_moe("mixtral", tmp_path / "mixtral")
    disk_keys(folder)   # {"model.layers.0.block_sparse_moe.experts.0.w1.weight", ...}
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
VOCAB = 320  # covers the byte tokenizer's 257 ids
# gpt_oss has no sdpa attention in transformers (its sinks): a run of it passes --attention eager
ATTENTION = {"gpt_oss": ["--attention", "eager"]}


def tiny_moe(model_type: str, seed: int = 0):
    """The tiny HF causal LM of `model_type`, fp32, random weights from `seed`."""
    import torch

    from models.weights import loading

    sys.path.insert(0, str(REPO / "bench"))
    from arch_sweep_config import causal_lm_class, tiny_config

    cls, config = causal_lm_class(tiny_config(model_type))
    config.vocab_size = VOCAB
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn":  # 64 positions: yarn's factor 32 then stretches 2 (transformers warns)
        rope["original_max_position_embeddings"] = config.max_position_embeddings // int(rope["factor"])
    return loading.random_model(config, seed=seed, cls=cls, attn_implementation="eager", dtype=torch.float32)


def save_tiny_moe(model_type: str, folder: Path, seed: int = 0, **save) -> Path:
    """tiny_moe(model_type) saved by save_pretrained (`save`: its options, max_shard_size=...) with the byte
    tokenizer: what a user fine-tunes."""
    from toolkit.train import hf

    tiny_moe(model_type, seed).save_pretrained(folder, **save)
    hf.byte_tokenizer().save_pretrained(folder)
    return Path(folder)


def disk_keys(folder: Path) -> set:
    """The tensor names a HF directory's safetensors hold (its index's, or model.safetensors')."""
    from safetensors import safe_open

    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(Path(folder) / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def read_disk(folder: Path) -> dict:
    """{name: tensor} of a HF directory's safetensors, every file."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}
