"""Streaming export: a dstk checkpoint -> sharded safetensors, about one layer in memory at a time.

    dstk export runs/x runs/x/hf_again --max-shard-size 2GB --dtype bf16

The HF model is built on the meta device (no memory): it gives every tensor's name and shape, and
which are tied (their duplicates are left out, as save_pretrained does). The shards are planned
from those shapes before any weight is read (HF's rule: in state-dict order, a new shard when the
next tensor would pass --max-shard-size; a larger tensor gets a shard of its own), each file is
created with its final safetensors header, and the tensors are written into place as the reader
(toolkit.checkpoint.stream) yields them, group by group. Peak memory ~ the largest group
(one pipeline layer, one HF block), not the model. One shard: model.safetensors; more:
model-0000k-of-0000n.safetensors + model.safetensors.index.json, the names from_pretrained reads.
"""

import json
import math
import re
import struct
from pathlib import Path

from toolkit.errors import ConfigError

SAFE_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
DEFAULT_SHARD = "5GB"  # save_pretrained's default
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def parse_size(text) -> int:
    """'500MB', '2GB', '1.5GiB' or a number of bytes -> bytes (decimal units, as HF's '5GB')."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    try:
        size = int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()]) if match else 0
    except ValueError:
        size = 0
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: give a size such as 500MB, 2GB or 5GB (bytes when no unit)")
    return size


def expected_tensors(skeleton) -> tuple[dict, dict]:
    """({name: (shape, dtype)} that save_pretrained writes, {every state-dict name: name written}) for
    a model on the meta device: tied duplicates (lm_head.weight) map to the name kept."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    full = skeleton.state_dict()
    for key in skeleton._keys_to_ignore_on_save or []:
        full.pop(key, None)
    kept = remove_tied_weights_from_state_dict(dict(full), skeleton)
    by_param = {}
    for name in kept:
        by_param[id(skeleton.get_parameter_or_buffer(name))] = name
    alias = {name: by_param.get(id(skeleton.get_parameter_or_buffer(name)), name) for name in full}
    return {name: (tuple(t.shape), t.dtype) for name, t in kept.items()}, alias


def plan_shards(sizes: dict, max_bytes: int) -> list:
    """[[names of shard 1], ...]: huggingface_hub's split (split_state_dict_into_shards_factory): in
    order, a new shard when the next tensor would pass max_bytes; a larger tensor has one of its own."""
    shards, current, current_size = [], [], 0
    for name, size in sizes.items():
        if size > max_bytes:
            shards.append([name])
            continue
        if current_size + size > max_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    return shards + ([current] if current else [])


class ShardWriter:
    """Safetensors files whose headers are written first (from the planned shapes) and whose
    tensors are then written into place in any order. Checks each tensor's size as it comes."""

    def __init__(self, folder: Path, specs: dict, max_bytes: int):
        self.specs = specs  # name -> (shape, torch dtype as written)
        sizes = {n: math.prod(shape) * dtype.itemsize for n, (shape, dtype) in specs.items()}
        shards = plan_shards(sizes, max_bytes)
        count = len(shards)
        self.files = [folder / (SAFE_NAME if count == 1 else f"model-{k + 1:05d}-of-{count:05d}.safetensors")
                      for k in range(count)]
        self.where, self.handles, self.written = {}, {}, set()  # name -> (file index, byte offset)
        for k, (path, names) in enumerate(zip(self.files, shards)):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for n in names:
                shape, dtype = specs[n]
                header[n] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                             "data_offsets": [offset, offset + sizes[n]]}
                offset += sizes[n]
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(raw)) + raw)
                f.truncate(8 + len(raw) + offset)
            for n in names:
                self.where[n] = (k, 8 + len(raw) + header[n]["data_offsets"][0])
        self.total_size = sum(sizes.values())
        self.weight_map = {n: self.files[k].name for n, (k, _) in self.where.items()}

    def write(self, name: str, tensor) -> None:
        import torch

        shape, dtype = self.specs[name]
        data = _shaped(name, tensor, shape).reshape(-1).to(dtype).contiguous()
        k, offset = self.where[name]
        if k not in self.handles:
            self.handles[k] = open(self.files[k], "r+b")
        self.handles[k].seek(offset)
        self.handles[k].write(data.view(torch.uint8).numpy().data if data.numel() else b"")
        self.written.add(name)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.files[0].parent / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_weights(reader, skeleton, folder: Path, dtype: str, max_bytes: int, where: str) -> dict:
    """Every tensor `reader` yields (by the model's names), cast (floating ones) to `dtype`, into sharded
    safetensors in `folder` under the names and layout save_pretrained writes (transformers' conversion
    reverted a group at a time: fused MoE experts back to one tensor per expert); refuses (before writing
    a byte of weights) a checkpoint missing some of the model's tensors or holding others. Returns
    {"shards": n, "total_size": bytes, "largest_group": bytes}."""
    import torch

    from models.weights.conversion import to_disk

    expected, alias = expected_tensors(skeleton)
    held = set(reader.names())
    missing = [n for n in expected if n not in held]
    unexpected = [n for n in held if n not in alias and n not in expected]
    if missing or unexpected:
        raise ConfigError(f"{where} does not match its model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    target = getattr(torch, dtype)
    with torch.device("meta"):  # the written names and shapes, from the model's, without a byte of memory
        shapes = to_disk(skeleton, {n: torch.empty(shape, dtype=t) for n, (shape, t) in expected.items()})
    specs = {n: (tuple(t.shape), target if t.is_floating_point() else t.dtype) for n, t in shapes.items()}
    writer = ShardWriter(folder, specs, max_bytes)
    largest, taken = 0, set()
    try:
        for group in reader.groups():
            largest = max(largest, sum(t.numel() * t.element_size() for t in group.values()))
            mine = {n: _shaped(n, t, expected[n][0]) for n, t in group.items() if n in expected and n not in taken}
            taken.update(mine)  # (pipeline masters come flat: the model's shapes before converting)
            del group
            for name, tensor in to_disk(skeleton, mine).items():
                writer.write(name, tensor)
            del mine
    finally:
        writer.close()
    unwritten = [n for n in specs if n not in writer.written]
    if unwritten:
        raise ConfigError(f"{where} does not match its model: missing {unwritten[:4]}, unexpected []")
    return {"shards": len(writer.files), "total_size": writer.total_size, "largest_group": largest}


def _shaped(name: str, tensor, shape: tuple):
    """`tensor` in `shape` (pipeline masters come flat); refused when it holds another number of values."""
    if tensor.numel() != math.prod(shape) or (tensor.dim() != 1 and tuple(tensor.shape) != shape):
        raise ConfigError(f"{name}: the checkpoint holds shape {tuple(tensor.shape)}, the model expects "
                          f"{shape}; was the checkpoint written for another model config?")
    return tensor.view(shape)


def export_streaming(ckpt_dir: Path, tag: str, manifest: dict, config, folder: Path, dtype: str,
                     max_bytes: int) -> dict:
    """Write a full (non-LoRA) checkpoint's HF directory into `folder` (config: its HF config; dtype:
    "float32", "bfloat16" or "float16"): config.json (+ "dtype"),
    generation_config.json when the model generates, the weights streamed, the tokenizer from dstk/.
    Raises NotStreamable (nothing useful written) for checkpoints the readers do not cover."""
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import models
    from toolkit.checkpoint.manifest import META
    from toolkit.checkpoint.stream import open_reader

    meta = ckpt_dir / META
    unset_hf_deepspeed_config()  # a plain skeleton, even in a process that trained under ZeRO-3
    with torch.device("meta"):
        skeleton = models.auto_class(manifest["task"]).from_config(config, dtype=torch.float32)
    _, alias = expected_tensors(skeleton)
    reader = open_reader(ckpt_dir / tag, manifest, alias)
    stats = write_weights(reader, skeleton, folder, dtype, max_bytes, str(ckpt_dir / tag))
    write_metadata(skeleton, meta, folder, dtype)
    return stats


def write_metadata(skeleton, meta: Path, folder: Path, dtype: str, base_dir: Path | None = None) -> None:
    """config.json (+ "dtype"), generation_config.json when the model generates (the --model directory's
    own where the base comes from there, as from_pretrained reads it), the tokenizer from dstk/."""
    from transformers import AutoTokenizer, GenerationConfig

    skeleton.config.dtype = dtype
    skeleton.config.architectures = [type(skeleton).__name__]
    skeleton.config.save_pretrained(folder)
    if skeleton.can_generate():
        own = base_dir is not None and (Path(base_dir) / "generation_config.json").exists()
        (GenerationConfig.from_pretrained(base_dir) if own else skeleton.generation_config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(meta).save_pretrained(folder)
