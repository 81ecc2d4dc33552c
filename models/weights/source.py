"""Where a pipeline stage gets its HF sub-modules: a live model in memory, or a local HF directory.

A stage asks its source for modules by their dotted HF name ("model.layers.3"). A `LiveSource`
hands out the model's own modules (so parameters are shared with the HF model: what the parity
tests need). A `DirSource` keeps a skeleton of the whole model on the meta device (no memory) and
materialises only the asked-for module, filling it from the directory's safetensors with
`safe_open`: a stage reads its own tensors and no rank builds the full model. Its parameters come out in
the DirSource's `dtype` (the run's: DeepSpeed's bf16/fp16 modes cast parameters to it anyway, so a bf16
checkpoint needs no fp32 copy on the host), its buffers in the dtype an fp32 build gives them (DeepSpeed
casts no buffer). Only what the directory does not hold is initialised (non-persistent buffers such as
rotary inv_freq; a head a base checkpoint lacks). A DirSource may be given `adapt(module, name) -> module`,
applied to each module once it is filled (LoRA: freeze it and inject adapters, lora.StageAdapters).
"""

from __future__ import annotations  # (nn.Module in signatures: torch is imported where a model is built)

import copy
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from models.weights.conversion import DiskNames
from toolkit.errors import UnusableInput

if TYPE_CHECKING:
    from torch import nn


class LiveSource:
    """Modules of a HF model already in memory (shared, not copied)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.skeleton = model  # same interface as DirSource for shape/parameter queries

    def module(self, name: str, allow_missing: bool = False) -> nn.Module:
        return self.model.get_submodule(name)

    def parameter(self, name: str, allow_missing: bool = False) -> nn.Parameter:
        return self.model.get_parameter(name)


class DirSource:
    """Modules of a model saved in a local HF directory, built one at a time from safetensors."""

    def __init__(self, path: str, model_cls, config, adapt=None, dtype=None):
        import torch

        self.path = path
        self.adapt = adapt
        self.dtype = dtype or torch.float32  # of the parameters; fp32: they are the optimizer's masters
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # stages are never ZeRO-3: an earlier ZeRO-3 model in this process must not count
        with torch.device("meta"):  # shapes only, no memory; fp32, as buffers come out of a model built in code
            self.skeleton = model_cls._from_config(config, dtype=torch.float32)
        self.stored = StoredTensors(path, self.skeleton)  # the directory's tensors by the model's names

    def module(self, name: str, allow_missing: bool = False) -> nn.Module:
        """Materialise HF module `name` on CPU, parameters in self.dtype, and fill it from the directory."""
        module = copy.deepcopy(self.skeleton.get_submodule(name))
        for p in module.parameters():
            p.data = p.data.to(self.dtype)  # still on meta: no memory
        module.to_empty(device="cpu")
        wanted = {f"{name}.{key}": t for key, t in module.state_dict(keep_vars=True).items()}  # filled in place
        stored = [full for full in wanted if self.stored.has(full)]
        _init_unstored(module, self.skeleton._init_weights, [wanted[full] for full in stored])
        self._load_into(wanted, stored)
        missing = [full for full in wanted if not self.stored.has(full)]
        if missing and not allow_missing:
            raise self._incomplete(name, missing)
        return self.adapt(module, name) if self.adapt else module

    def parameter(self, name: str, allow_missing: bool = False) -> nn.Parameter:
        import torch
        from torch import nn

        values = {name: torch.zeros(self.skeleton.get_parameter(name).shape, dtype=self.dtype)}
        # (a head bias absent from a base-model checkpoint starts at 0, as in HF)
        if not self.stored.has(name) and not allow_missing:
            raise self._incomplete(name, [name])
        self._load_into(values, [name] if self.stored.has(name) else [])
        return nn.Parameter(values[name])

    def _load_into(self, tensors: dict, names: list) -> None:
        """Copy the stored tensors `names` (HF names, as the model holds them) into `tensors[name]` in
        place, cast to its dtype: each made from the checkpoint's own tensors through transformers'
        conversion (per-expert files -> fused experts), one conversion group at a time."""
        import torch

        with torch.no_grad():
            for group in self.stored.read_groups(names):
                for full, value in group.items():
                    if tuple(value.shape) != tuple(tensors[full].shape):
                        raise UnusableInput(f"{self.path}: {full} comes out {tuple(value.shape)} from the safetensors "
                                            f"files where config.json makes it {tuple(tensors[full].shape)}; the "
                                            "files are incomplete or another model's: copy the model's files again")
                    tensors[full].copy_(value)  # copy_ casts, as .to() would

    def _incomplete(self, name: str, missing: list) -> UnusableInput:
        """The refusal for tensors the directory lacks, named as the files would name them."""
        from models.weights.conversion import to_disk

        on_disk = sorted(to_disk(self.skeleton, {n: self.skeleton.get_parameter_or_buffer(n) for n in missing}))
        return UnusableInput(f"{self.path}: the safetensors files lack {len(on_disk)} tensor(s) of {name!r}: "
                             f"{', '.join(on_disk[:4])}{' ...' if len(on_disk) > 4 else ''}; the checkpoint is "
                             "incomplete (copy the model's files again) or config.json is another model's")


class StoredTensors:
    """A HF directory's safetensors, read by the model's names: each tensor made from the files' own
    through transformers' conversion (models.weights.conversion), reading only what is asked for.
    skeleton: the model (meta device is enough)."""

    def __init__(self, path, skeleton):
        self.path = os.fspath(path)
        self.weight_map = weight_map(self.path)  # the files' tensor name -> safetensors file
        self.names = DiskNames(skeleton, self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.names.owner

    def read_groups(self, names):
        """{model name: tensor} for `names` (those the directory holds), a conversion group at a time
        (one tensor, or one layer's fused experts). A file is opened for the group that reads it and closed
        after: an open safe_open maps its file, and every page read stays resident while it is open (a reader
        of a whole model, the streamed export, would hold the whole file)."""
        from safetensors import safe_open

        handles = {}

        def get_tensor(key):
            file = self.weight_map[key]
            if file not in handles:
                handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
            return handles[file].get_tensor(key)

        for group in self.names.read_groups(names, get_tensor):
            handles.clear()  # (the tensors are copies: the group holds no page of the files)
            yield group


def check_complete(path, skeleton) -> None:
    """Refuse a directory that lacks tensors of the model's body (skeleton: the HF model on the meta device),
    named as the files name them: a tensor with no source under any name transformers reads, or a part of
    one (an expert's tensor of a layer's fused experts). Heads outside the base model may be absent (a base
    checkpoint under a classifier: initialised, as from_pretrained does), and so may buffers. Reads the
    index or the safetensors headers alone."""

    prefix = f"{skeleton.base_model_prefix}."
    ignored = [*(skeleton._keys_to_ignore_on_save or []), *(skeleton._keys_to_ignore_on_load_missing or [])]
    stored = StoredTensors(path, skeleton)
    names_of = {}  # a parameter's names: several where tied (embed_tokens and lm_head)
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    body = [names[0] for names in names_of.values() if names[0].startswith(prefix)
            and not any(re.search(pattern, names[0]) for pattern in ignored)
            and not any(stored.has(n) for n in names[1:])]  # a tied one stored under another of its names
    lacking = stored.names.lacking(body)
    if lacking:
        index = os.path.isfile(os.path.join(stored.path, "model.safetensors.index.json"))
        source = "model.safetensors.index.json" if index else "model.safetensors"
        raise UnusableInput(f"{path}: {source} lacks {len(lacking)} tensor(s) that its config.json's model needs: "
                            f"{', '.join(lacking[:4])}{' ...' if len(lacking) > 4 else ''}; the checkpoint is "
                            "incomplete: copy the model's files again")


def _init_unstored(module: nn.Module, init_weights, loaded: list) -> None:
    """HF's init (`init_weights`, per sub-module) for what the checkpoint does not hold: tensors in `loaded`
    are flagged `_is_hf_initialized`, which transformers' init functions skip (from_pretrained's own rule),
    so no random matrix is drawn only to be overwritten. Sub-modules wholly loaded are not visited."""
    import torch
    from transformers import initialization

    skip = {id(t) for t in loaded}

    def init(sub):  # non-persistent buffers are never loaded; a parent may init its children's tensors
        if any(id(t) not in skip for t in [*sub.parameters(), *sub.buffers()]):
            init_weights(sub)

    for t in loaded:
        t._is_hf_initialized = True
    try:
        with torch.no_grad(), initialization.guard_torch_init_functions():  # torch.nn.init.* checks the flag too
            module.apply(init)  # children first, as module.apply(init_weights) did
    finally:
        for t in {id(t): t for t in loaded}.values():  # a tensor tied within the module is listed twice
            del t._is_hf_initialized


def weight_map(path: str) -> dict:
    """tensor name -> file, from model.safetensors.index.json or a single model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise UnusableInput(f"{path}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors checkpoints can be loaded per stage; convert .bin files "
                            "with save_pretrained(safe_serialization=True))")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {key: "model.safetensors" for key in f.keys()}


def check_model_folder(path, flag: str = "--model") -> None:
    """The one check that `path` is a local HF model folder: a directory holding config.json (as save_pretrained
    writes it); else one message, naming the option (`flag`) that gave it."""
    if not os.path.isdir(path):
        raise UnusableInput(f"{flag} {path}: no such directory (a local HF model directory with config.json is "
                            "needed, or a hub id, org/name)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UnusableInput(f"{flag} {path}: no config.json in this directory, so it is not a HF model directory "
                            "(one written by save_pretrained)")


def check_directory(path) -> None:
    """A local HF model directory dstk will read: config.json is JSON, and each safetensors file (the
    index's, or model.safetensors) has a readable header and every byte its header promises. Read from
    the headers alone (a few KiB a file), before any model is built; other weight formats are left to
    transformers."""
    path = Path(path)
    config = path / "config.json"
    try:
        content = json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UnusableInput(f"{config} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); restore "
                            "the model's config.json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UnusableInput(f"{config} cannot be read ({exc}); restore the model's config.json") from None
    if not isinstance(content, dict) or not isinstance(content.get("model_type"), str):
        raise UnusableInput(f"{config} is not a HF model config (a JSON object with a \"model_type\"); restore the "
                            "model's config.json")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    broken = [name for name in weights if (path / name).is_symlink() and not (path / name).exists()]
    if broken:
        raise UnusableInput(f"{path / broken[0]} is a broken link (to {os.readlink(path / broken[0])}, which is gone); "
                            "copy or download the model's files again")
    if not any((path / name).is_file() for name in weights):
        raise UnusableInput(f"{path} holds no weights (none of {', '.join(weights)}); copy the model's weight files "
                            "there, or pass a built-in name to train from random weights")
    source, names = _checked_weights(path)
    holes = expert_holes(names)
    if holes:
        raise UnusableInput(f"{path}: {source} lacks {len(holes)} tensor(s) that the other experts of their layer "
                            f"have: {', '.join(holes[:4])}{' ...' if len(holes) > 4 else ''}; the checkpoint is "
                            "incomplete: copy the model's files again")


def _checked_weights(path: Path) -> tuple:
    """(the file that lists the tensors: the index, else model.safetensors; the names it lists), every
    safetensors file's header checked (none: other weight formats)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        single = path / "model.safetensors"
        return single.name, check_safetensors(single, index) if single.is_file() else []
    try:
        listed = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(listed.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UnusableInput(f"{index} is not a safetensors index (no readable weight_map: {exc}); restore it "
                            "with the model's files") from None
    for name in files:
        check_safetensors(path / name, index)
    return index.name, list(listed)  # what a loader looks up


EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(.+)")  # a per-expert tensor on disk: (layer's experts, e, leaf)


def expert_holes(names) -> list:
    """The per-expert tensors a checkpoint's names lack, from the names alone (no model): a leaf
    (`...experts.{e}.w1.weight`) that expert e of a layer lacks while a later expert of that layer has it, or the
    same expert of another layer does, is missing; so is a number skipped. Not every expert holds every leaf:
    longcat_flash's zero-computation experts (the last ones) have no down_proj in any layer. (The ranks check the
    rest against the model: check_complete.)"""
    layers = {}
    for name in names:
        if match := EXPERT.fullmatch(name):
            layers.setdefault(match[1], {}).setdefault(int(match[2]), set()).add(match[3])
    held = {}  # (expert, leaf) -> the layers holding it
    for layer, experts in layers.items():
        for e, leaves in experts.items():
            for leaf in leaves:
                held.setdefault((e, leaf), set()).add(layer)
    holes = []
    for layer, experts in layers.items():
        for e in range(max(experts) + 1):
            for leaf in sorted({leaf for (_, leaf) in held} - experts.get(e, set())):
                later = any(leaf in experts.get(f, ()) for f in range(e + 1, max(experts) + 1))
                if later or held.get((e, leaf)):  # a later expert of the layer, or this expert elsewhere, has it
                    holes.append(f"{layer}.{e}.{leaf}")
    return holes


def check_safetensors(file: Path, index: Path) -> list:
    """The file's 8-byte header length, its JSON header, and a size that holds every tensor it lists; returns
    the names of its tensors."""
    if not file.is_file():
        raise UnusableInput(f"{file} is missing ({index.name} names it); copy the model's files again")
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or length > min(size - 8, 1 << 28):
            raise UnusableInput(f"{file} is not a safetensors file ({size} bytes, no valid header length); copy "
                                "the model's weights again")
        try:
            header = json.loads(fh.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise UnusableInput(f"{file} has a damaged safetensors header; copy the model's weights again") from None
    need = 8 + length + max(ends, default=0)
    if size < need:
        raise UnusableInput(f"{file} is cut short: {size} bytes where its header lists {need}; copy the model's "
                            "weights again") from None
    return [key for key in header if key != "__metadata__"]
