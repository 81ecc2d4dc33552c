"""DeepSpeed checkpoints written by `dstk train`: saving, `latest`, and what export needs beside them.

Layout of CHECKPOINT_DIR:
  global_stepN/          DeepSpeed's own files: mp_rank_00_model_states.pt (+ ZeRO shards) for
                         pp = 1, layer_XX-model_states.pt per pipeline layer for pp > 1
  global_stepN/rng_state_R.pt  rank R's random-number generators (python, numpy, torch CPU and CUDA: what
                         dropout draws from), one file per global rank as the HF Trainer writes them
  latest                 the tag of the newest COMPLETE checkpoint, written by us after every rank
                         finished saving (os.replace: a run killed mid-save leaves the old one)
  dstk/                  config.json + tokenizer + layout.json (task, pp, HF names per layer)
"""

import json
import os
import re
from pathlib import Path

from toolkit.distributed.process_group import patient_group
from toolkit.errors import ConfigError, UnusableInput

META = "dstk"
TAG_LAYOUT = "dstk-layout.json"  # a tag's own copy of layout.json (the run may have moved since)


def save(engine, ckpt_dir: Path, step: int, frozen: bool = True, param_names=None, layout=None) -> str:
    """Save every rank's part under tag global_step<step>, then point `latest` at it. frozen=False
    leaves frozen parameters out (a LoRA run's base: its --model directory holds it unchanged).
    param_names: this rank's optimizer parameters by name, per group, in the order the optimizer got
    them (saved with the rank's states: what names torch's optimizer state for another layout).
    layout: the run's layout.json, also written into the tag (TAG_LAYOUT): the layout that tag has."""
    import torch.distributed as dist

    tag = f"global_step{step}"
    client = {"step": step, "param_names": param_names}
    if (layout or {}).get("tp", 1) == 1:  # AutoTP writes its own: how its shards make each full tensor
        client.update(universal_info())
    elif getattr(engine.module, "dstk_tp_info", None):  # tp inside pipeline stages: this stage's map
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        client[UNIVERSAL_CHECKPOINT_INFO] = engine.module.dstk_tp_info
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False,
                           exclude_frozen_parameters=not frozen)
    save_rng(Path(ckpt_dir) / tag, dist.get_rank())  # DeepSpeed keeps the client state of dp rank 0 only
    dist.barrier(group=patient_group())  # every rank's files are on disk before `latest` names the tag (slow disks)
    if dist.get_rank() == 0:
        if layout is not None:
            (Path(ckpt_dir) / tag / TAG_LAYOUT).write_text(json.dumps(layout, indent=1))
        write_latest(ckpt_dir, tag)
    dist.barrier()
    return tag


RNG_STATE = "rng_state_{}.pt"  # per global rank


def save_rng(tag_dir: Path, rank: int) -> None:
    """Write this rank's generators into the tag, atomically (a rank killed mid-write leaves no file)."""
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}  # this rank's device
    path = tag_dir / RNG_STATE.format(rank)
    path.parent.mkdir(parents=True, exist_ok=True)  # a rank that wrote no DeepSpeed file may come first
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_rng(tag_dir: Path, rank: int) -> bool:
    """Restore the generators rank `rank` saved in the tag (the same layout: the same rank, replica and
    stage); False when the tag has none (written by an older dstk)."""
    import random

    import numpy as np
    import torch

    path = tag_dir / RNG_STATE.format(rank)
    if not path.is_file():
        return False
    state = torch.load(path, weights_only=False)  # numpy's state is an array in a tuple; our own file
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


def universal_info() -> dict:
    """What DeepSpeed's ds_to_universal needs in a checkpoint to convert it (ZeRO-1/2 and bf16 runs): no
    tensor parallelism here, and a tied embedding's copies on later pipeline stages are replicas of the
    first stage's (tied_modules.*, all-reduced every step), to be taken once."""
    from deepspeed.checkpoint import constants as c

    return {c.UNIVERSAL_CHECKPOINT_INFO: {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                                          c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\..*"],
                                          c.TP_REPLICATED_PARAMETER_PATTERNS: [r".*"]}}


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """Atomically replace CHECKPOINT_DIR/latest with `tag`, durably: the new file's bytes reach the
    disk before the rename, and the rename before we return (a power cut leaves old or new)."""
    tmp = Path(ckpt_dir) / f".latest.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(ckpt_dir) / "latest")
    directory = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_latest(ckpt_dir: Path) -> str | None:
    path = Path(ckpt_dir) / "latest"
    return path.read_text().strip() if path.is_file() else None


def agreed_latest(ckpt_dir: Path) -> str | None:
    """`latest` as rank 0 reads it, on every rank (node-local disks or caches can disagree)."""
    import torch.distributed as dist

    box = [read_latest(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def step_of(tag: str) -> int:
    match = re.fullmatch(r"global_step(\d+)", tag)
    if not match:
        raise UnusableInput(f"checkpoint tag {tag!r} is not global_stepN; was it written by dstk train?")
    return int(match.group(1))


def tag_layout(ckpt_dir: Path, tag: str) -> dict:
    """The layout checkpoint `tag` was written with: its own copy, else the run's layout.json."""
    own = Path(ckpt_dir) / tag / TAG_LAYOUT
    return json.loads((own if own.is_file() else Path(ckpt_dir) / META / "layout.json").read_text())


def move_meta(ckpt_dir: Path, layout: dict) -> None:
    """The run continues on another layout: every tag without its own copy keeps the old layout.json,
    which then becomes `layout`."""
    meta = Path(ckpt_dir) / META / "layout.json"
    old = meta.read_text()
    for tag_dir in Path(ckpt_dir).glob("*/"):
        if tag_dir.name != META and tag_dir.is_dir() and not (tag_dir / TAG_LAYOUT).exists():
            (tag_dir / TAG_LAYOUT).write_text(old)
    tmp = meta.with_name(f".layout.{os.getpid()}")
    tmp.write_text(json.dumps(layout, indent=1))
    os.replace(tmp, meta)


def save_meta(ckpt_dir: Path, config, tokenizer, layout: dict) -> None:
    """What export needs besides the weights: the HF config, the tokenizer, the layer layout."""
    meta = Path(ckpt_dir) / META
    meta.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(meta)
    tokenizer.save_pretrained(meta)
    (meta / "layout.json").write_text(json.dumps(layout, indent=1))


RUN_KEYS = ("model", "tokenizer", "task", "seq_len", "lora", "data")  # what a resume must match
LAYOUT_KEYS = ("pp", "dp", "tp", "zero_stage")  # what may change on resume (toolkit.checkpoint.portable)


def check_resumable(ckpt_dir: Path, now: dict, tag: str | None = None) -> list:
    """Refuse to resume a checkpoint written with another model, tokenizer, task, seq-len or LoRA setting,
    and a move to another layout that cannot be honoured; returns the layout keys that change (pp, dp,
    zero_stage: the run continues there through toolkit.checkpoint.portable)."""
    saved = tag_layout(ckpt_dir, tag) if tag else json.loads((Path(ckpt_dir) / META / "layout.json").read_text())
    if "task" in saved:  # a run started with `--task classification` recorded the short name
        from models import task_named

        saved = {**saved, "task": task_named(saved["task"])}
    diffs = [_diff(k, saved[k], now.get(k)) for k in RUN_KEYS if k in saved and saved[k] != now.get(k)]
    if diffs:
        raise ConfigError(f"--resume: {ckpt_dir} was written by another run ({'; '.join(diffs)}); resume with the same "
                          "--model, --tokenizer, --task, --seq-len, LoRA options and data (--data, --format, --packing, "
                          "--eval-fraction, --eval-data, --seed), or start a fresh --out")
    moved = [k for k in LAYOUT_KEYS if k in saved and saved[k] != now.get(k)]
    was = ", ".join(f"{k} {saved[k]}" for k in LAYOUT_KEYS if k in saved)
    why = None
    if moved and max(saved.get("tp", 1), now.get("tp", 1)) > 1:
        why = ("a tensor-parallel checkpoint holds each tensor in tp shards, which only `dstk export` merges "
               "today; export it and start a new run from the HF directory")
    elif moved and not saved.get("portable"):
        why = "the checkpoint was written by an older dstk that did not name its optimizer states"
    if why:
        raise ConfigError(f"--resume: {ckpt_dir} was written with {was} and this run has "
                          f"{', '.join(f'{k} {now.get(k)}' for k in LAYOUT_KEYS)}: {why}; resume with the "
                          "checkpoint's layout (its config), or start a fresh --out")
    return moved


def _diff(key: str, saved, now) -> str:
    """`key: checkpoint A, now B`; for a group of settings (data), only the ones that differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return "; ".join(f"{key}.{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
                         for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k))
    return f"{key}: checkpoint {saved!r}, now {now!r}"


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
