"""A dstk-trained DeepSpeed checkpoint -> a HF directory (safetensors, config, tokenizer).

Pipeline checkpoints hold one file per layer (layer_XX-model_states.pt): the layout saved beside
them maps each layer's keys back to HF names. pp = 1 checkpoints hold the HF state dict itself
(ZeRO-3 as shards, gathered with DeepSpeed's zero_to_fp32).
"""

import json
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput
from toolkit.train.checkpoint import META, read_latest
from toolkit.train.hf import MODEL_TASKS


def load_state_dict(ckpt_dir: Path, tag: str | None = None) -> tuple[dict, dict]:
    """(HF state dict in fp32, layout) from a pipeline or pp = 1 (incl. ZeRO) checkpoint."""
    import torch

    ckpt_dir = Path(ckpt_dir)
    tag = tag or read_latest(ckpt_dir)
    if tag is None or not (ckpt_dir / tag).is_dir():
        raise UnusableInput(f"{ckpt_dir} holds no complete checkpoint (no 'latest' file naming a tag directory)")
    layout = json.loads((ckpt_dir / META / "layout.json").read_text())
    if layout.get("pp", 1) > 1:
        state = _pipeline_state(ckpt_dir / tag, layout["hf_names"])
    elif list((ckpt_dir / tag).glob("zero_pp_rank_*_mp_rank_00_model_states.pt")) and _zero3(ckpt_dir / tag):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        state = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
    return {k: v.float() for k, v in state.items()}, layout


def _zero3(tag_dir: Path) -> bool:
    import torch

    files = sorted(tag_dir.glob("*optim_states.pt"))
    if not files:
        return False
    sd = torch.load(files[0], map_location="cpu", weights_only=False)
    return sd.get("optimizer_state_dict", {}).get("zero_stage") == 3


def _pipeline_state(tag_dir: Path, hf_names: list) -> dict:
    """layer_XX-model_states.pt (keys relative to the layer) -> HF names via the saved layout.

    hf_names[i] is {key in layer i's state dict: HF parameter name}."""
    import torch

    state = {}
    for i, names in enumerate(hf_names):
        path = tag_dir / f"layer_{i:02d}-model_states.pt"
        if not names or (not path.exists() and set(names.values()) <= set(state)):
            continue  # DeepSpeed saves a tied module once, with its first layer
        if not path.exists():
            raise UnusableInput(f"{path} is missing: the checkpoint is incomplete or from another layout")
        layer = torch.load(path, map_location="cpu", weights_only=False)
        for key, hf in names.items():
            state[hf] = layer[key]
    return state


def export(ckpt_dir, out_dir, tag: str | None = None) -> Path:
    """Write OUT_DIR = a HF directory (safetensors, config, tokenizer) with the checkpoint's weights."""
    from transformers import AutoConfig, AutoTokenizer

    import models

    meta = Path(ckpt_dir) / META
    if not meta.is_dir():
        raise UnusableInput(f"{ckpt_dir} has no {META}/ folder: it was not written by dstk train")
    state, layout = load_state_dict(ckpt_dir, tag)
    config = AutoConfig.from_pretrained(meta)
    cls = models.auto_class(MODEL_TASKS[layout["task"]])
    model = cls.from_config(config)  # CPU, fp32; every weight is then overwritten
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _tied(model, k)]
    if missing or unexpected:
        raise ConfigError(f"{ckpt_dir} does not match its model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(meta).save_pretrained(out_dir)
    return out_dir


def _tied(model, key: str) -> bool:
    """Whether `key` is a weight HF ties to another (lm_head.weight -> embeddings)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied
