"""DeepSpeed checkpoints written by `dstk train`, and their conversion to a HF directory.

Layout of CHECKPOINT_DIR:
  global_stepN/          DeepSpeed's own files: mp_rank_00_model_states.pt (+ ZeRO shards) for
                         pp = 1, layer_XX-model_states.pt per pipeline layer for pp > 1
  latest                 the tag of the newest COMPLETE checkpoint, written by us after every rank
                         finished saving (os.replace: a run killed mid-save leaves the old one)
  dstk/                  config.json + tokenizer + layout.json (task, pp, HF names per layer)
"""

import json
import os
import re
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput

META = "dstk"


def save(engine, ckpt_dir: Path, step: int) -> str:
    """Save every rank's part under tag global_step<step>, then point `latest` at it."""
    import torch.distributed as dist

    tag = f"global_step{step}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    dist.barrier()  # every rank's files are on disk before `latest` names the tag
    if dist.get_rank() == 0:
        write_latest(ckpt_dir, tag)
    dist.barrier()
    return tag


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """Atomically replace CHECKPOINT_DIR/latest with `tag`."""
    tmp = Path(ckpt_dir) / f".latest.{os.getpid()}"
    tmp.write_text(tag)
    os.replace(tmp, Path(ckpt_dir) / "latest")


def read_latest(ckpt_dir: Path) -> str | None:
    path = Path(ckpt_dir) / "latest"
    return path.read_text().strip() if path.is_file() else None


def step_of(tag: str) -> int:
    match = re.fullmatch(r"global_step(\d+)", tag)
    if not match:
        raise UnusableInput(f"checkpoint tag {tag!r} is not global_stepN; was it written by dstk train?")
    return int(match.group(1))


def save_meta(ckpt_dir: Path, config, tokenizer, layout: dict) -> None:
    """What export needs besides the weights: the HF config, the tokenizer, the layer layout."""
    meta = Path(ckpt_dir) / META
    meta.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(meta)
    tokenizer.save_pretrained(meta)
    (meta / "layout.json").write_text(json.dumps(layout, indent=1))


def _shape_keys(config) -> dict:
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "n_embd", "n_layer",
            "intermediate_size", "num_attention_heads", "n_head", "num_labels")
    d = config.to_dict()
    return {k: d.get(k) for k in keep if k in d}


def check_same_model(ckpt_dir: Path, config) -> None:
    """Refuse to resume a checkpoint that another model (other shapes) wrote."""
    from transformers import AutoConfig

    saved = _shape_keys(AutoConfig.from_pretrained(Path(ckpt_dir) / META))
    now = _shape_keys(config)
    diff = {k: (saved.get(k), now.get(k)) for k in set(saved) | set(now) if saved.get(k) != now.get(k)}
    if diff:
        pairs = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ConfigError(f"checkpoint {ckpt_dir} was written by another model ({pairs}); "
                          f"use a fresh --out, or the --model it was trained with")


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    meta = Path(ckpt_dir) / META
    if not meta.is_dir():
        raise UnusableInput(f"{ckpt_dir} has no {META}/ folder: it was not written by dstk train")
    state, layout = load_state_dict(ckpt_dir, tag)
    config = AutoConfig.from_pretrained(meta)
    cls = AutoModelForSequenceClassification if layout["task"] == "classification" else AutoModelForCausalLM
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
