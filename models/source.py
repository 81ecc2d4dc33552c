"""Where a pipeline stage gets its HF sub-modules: a live model in memory, or a local HF directory.

A stage asks its source for modules by their dotted HF name ("model.layers.3"). A `LiveSource`
hands out the model's own modules (so parameters are shared with the HF model: what the parity
tests need). A `DirSource` keeps a skeleton of the whole model on the meta device (no memory) and
materialises only the asked-for module, filling it from the directory's safetensors with
`safe_open`: a stage reads its own tensors and no rank builds the full model. A DirSource may be
given `adapt(module, name) -> module`, applied to each module once it is filled (LoRA: freeze it and
inject adapters, toolkit.train.lora.StageAdapters).
"""

import copy
import json
import os

import torch
from torch import nn

from toolkit.errors import ConfigError, UnusableInput


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

    def __init__(self, path: str, model_cls, config, adapt=None):
        self.path = path
        self.adapt = adapt
        with torch.device("meta"):
            # shapes only, no memory; fp32 whatever the checkpoint's dtype: trainable weights are the
            # optimizer's masters (DeepSpeed's bf16/fp16 modes cast the module and keep fp32 copies)
            self.skeleton = model_cls._from_config(config, dtype=torch.float32)
        self.prefix = model_cls.base_model_prefix  # "model", "transformer", "bert", ...
        self.weight_map = _weight_map(path)  # tensor name -> safetensors file

    def module(self, name: str, allow_missing: bool = False) -> nn.Module:
        """Materialise HF module `name` on CPU and fill it from the directory."""
        module = copy.deepcopy(self.skeleton.get_submodule(name)).to_empty(device="cpu")
        with torch.no_grad():
            module.apply(self.skeleton._init_weights)  # sets non-persistent buffers (rotary, scales)
        wanted = module.state_dict()
        missing = self._load_into(name, wanted)
        if missing and not allow_missing:
            raise ConfigError(f"{self.path}: tensors for {name!r} missing from the safetensors files: "
                              f"{sorted(missing)[:4]}; the directory does not match its config.json")
        # state_dict() tensors share storage with the module: filled in place
        return self.adapt(module, name) if self.adapt else module

    def parameter(self, name: str, allow_missing: bool = False) -> nn.Parameter:
        module_name, _, attr = name.rpartition(".")
        values = {attr: torch.empty_like(self.skeleton.get_parameter(name), device="cpu")}
        values[attr].zero_()  # a head bias absent from a base-model checkpoint starts at 0, as in HF
        missing = self._load_into(module_name, values)
        if missing and not allow_missing:
            raise ConfigError(f"{self.path}: tensor {name!r} missing from the safetensors files")
        return nn.Parameter(values[attr])

    def _load_into(self, name: str, tensors: dict) -> set:
        """Copy the stored tensors `name.<key>` into `tensors` in place; return the keys not found."""
        from safetensors import safe_open

        found, by_file = set(), {}
        for key in tensors:
            stored = self._stored_name(f"{name}.{key}")
            if stored is not None:
                by_file.setdefault(self.weight_map[stored], []).append((key, stored))
        for file, pairs in by_file.items():
            with safe_open(os.path.join(self.path, file), framework="pt") as f:
                for key, stored in pairs:
                    tensors[key].copy_(f.get_tensor(stored).to(tensors[key].dtype))
                    found.add(key)
        return set(tensors) - found

    def _stored_name(self, full_name: str):
        """The checkpoint's name for a tensor: with the base prefix, or without (a saved base model)."""
        if full_name in self.weight_map:
            return full_name
        short = full_name.removeprefix(self.prefix + ".")
        return short if short in self.weight_map else None


def _weight_map(path: str) -> dict:
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
