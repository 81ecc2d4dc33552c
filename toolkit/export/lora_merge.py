"""Streaming LoRA export: the adapters merged into the base one tensor at a time, never the whole model.

    dstk export runs/lora runs/lora/hf --adapter-dir runs/lora/adapter --dtype bf16

Two passes over the checkpoint (toolkit.checkpoint.stream, about one layer in memory at a
time): the first keeps the adapters (lora_A, lora_B and a classifier head PEFT trains whole: small);
the second reads the base, from the run's --model safetensors when export takes the base from there
(toolkit.export.directory decides), else from the checkpoint, and writes each tensor (+ its adapted
linear's delta) into the shards as toolkit.export.stream does. The delta is peft's merge,
in fp32: W += transpose(B @ A, fan_in_fan_out) * alpha / r (fan_in_fan_out: GPT-2's Conv1D).
Peak memory ~ one layer + the adapters. The PEFT adapter folder is saved (by the caller) from a
meta-device PeftModel holding the adapters alone.
"""

import json
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.train.lora import PEFT_PREFIX, base_name, is_adapter

ADAPTER = "default"  # the adapter name dstk's PeftModels use


def hf_name(name: str) -> str:
    """A checkpoint's name (PeftModel's, or a pipeline's) -> the HF model's: no PEFT prefix, a base tensor without
    its `.base_layer`s, a head PEFT trains whole under its own name (`score.modules_to_save.default.weight`); a
    LoRA matrix keeps its wrapper's path (an expert module's adapters: experts.lora_A, experts.base_layer.lora_A)."""
    name = name.removeprefix(PEFT_PREFIX).replace(f".modules_to_save.{ADAPTER}.", ".")
    return name if ".lora_" in name else base_name(name)


class SafetensorsReader:
    """A HF directory's safetensors by the model's names (the reader interface of toolkit.checkpoint.stream),
    converted as from_pretrained converts them (per-expert files -> fused experts); `keep`: the names
    to give (others are not read). skeleton: the HF model on the meta device."""

    def __init__(self, folder: Path, skeleton, keep):
        from models.weights.source import StoredTensors
        from toolkit.errors import UnusableInput

        try:
            self.stored = StoredTensors(folder, skeleton)
        except UnusableInput as exc:  # no safetensors there
            raise FileNotFoundError(str(exc)) from None
        self.folder, self.keep = folder, [n for n in self.stored.names.owner if n in keep]
        self.files = set(self.keep)

    def names(self) -> list:
        return list(self.keep)

    def read(self, name: str):
        return next(self.stored.read_groups([name]))[name]

    def groups(self):
        """A conversion group at a time (one tensor, or one layer's fused experts): what the merge holds twice."""
        yield from self.stored.read_groups(self.keep)


def expert_wrappers(wrapped) -> dict:
    """{HF name of an expert parameter peft adapts (target_parameters): (its ParamWrapper's name, E, whether peft
    swapped in and out)} in the PeftModel `wrapped` (meta device is enough)."""
    from peft.tuners.lora.layer import ParamWrapper

    found = {}
    for name, module in wrapped.named_modules():
        if isinstance(module, ParamWrapper):
            path = name.removeprefix(PEFT_PREFIX)
            found[base_name(path + ".") + module.parameter_name] = (path, module.num_experts,
                                                                    module._did_swap_in_out_features)
    return found


class MergedReader:
    """The base tensors `bases` yields that the model saves (`keep`), + `extra` (from the checkpoint),
    with the adapters merged into the linears and expert parameters they adapt: a reader for stream.write_weights."""

    def __init__(self, bases, keep, extra: dict, adapters: dict, scaling: float, fan_in_fan_out: bool,
                 experts: dict | None = None):
        self.bases, self.keep, self.extra, self.adapters = bases, keep, extra, adapters
        self.scaling, self.fan_in_fan_out, self.experts = scaling, fan_in_fan_out, experts or {}
        self.merged = set()  # the linears and expert wrappers merged (each must be, once)

    def names(self) -> list:
        return [n for n in self.bases.names() if n in self.keep and n not in self.extra] + list(self.extra)

    def groups(self):
        for group in self.bases.groups():
            merged = {}
            for name in list(group):
                base = group.pop(name)  # let go of each base tensor once merged
                if name in self.keep and name not in self.extra:
                    merged[name] = self._merged(name, base)
            del group
            yield merged
        yield dict(self.extra)

    def _merged(self, name: str, weight):
        if name in self.experts:
            return self._merged_experts(name, weight)
        module = name.removesuffix(".weight")
        down = self.adapters.get(f"{module}.lora_A.{ADAPTER}.weight")  # (r, in)
        if down is None or not name.endswith(".weight"):
            return weight
        up = self.adapters[f"{module}.lora_B.{ADAPTER}.weight"]  # (out, r)
        delta = (up @ down).T if self.fan_in_fan_out else up @ down  # peft's get_delta_weight, in fp32
        self.merged.add(module)
        return weight.float().view(delta.shape) + delta * self.scaling  # peft: base_layer.weight.data += delta

    def _merged_experts(self, name: str, weight):
        """peft's ParamWrapper.get_delta_weight, in fp32: lora_A (r E, in) and lora_B (out, r E) as E pairs."""
        import torch

        path, experts, swapped = self.experts[name]
        down = self.adapters[f"{path}.lora_A.{ADAPTER}.weight"]
        up = self.adapters[f"{path}.lora_B.{ADAPTER}.weight"]
        if experts == 1:
            delta = up @ down
        else:
            a, b = down.reshape(experts, -1, down.shape[-1]), up.reshape(up.shape[0], -1, experts)
            delta = torch.einsum("o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", b, a)
        self.merged.add(path)
        return weight.float() + delta * self.scaling

    def check_all_merged(self, where: str) -> None:
        linears = {n.rsplit(".lora_A.", 1)[0] for n in self.adapters if ".lora_A." in n}
        if linears - self.merged:
            raise ConfigError(f"{where}: adapters without a base weight to merge into: "
                              f"{sorted(linears - self.merged)[:4]}")


def export_lora_streaming(ckpt_dir: Path, tag: str, manifest: dict, config, out: Path, dtype: str, max_bytes: int,
                          base_dir: Path | None, save_adapters=None, merge: bool = True,
                          check_base: bool = False) -> dict:
    """Write a LoRA run's merged HF directory into `out` (merge=False: nothing there); save_adapters
    (when given) is called with a meta-device PeftModel holding the adapters alone. base_dir: the
    --model directory to read the base from (None: the checkpoint's base); check_base: unless a sample of the checkpoint's frozen
    tensors equals the directory's (up to bf16 rounding), the checkpoint's base instead. Raises
    NotStreamable (nothing written) where the readers do not cover the checkpoint or the directory
    holds no safetensors."""
    from toolkit.checkpoint.manifest import META
    from toolkit.checkpoint.stream import NotStreamable, open_reader
    from toolkit.export.stream import expected_tensors, write_metadata, write_weights

    skeleton, wrapped = _skeletons(config, manifest)
    expected, tied = expected_tensors(skeleton)  # tied: every state-dict name -> the name written
    tag_dir = ckpt_dir / tag
    names = open_reader(tag_dir, manifest, {}).names()
    alias = {n: tied.get(hf_name(n), hf_name(n)) for n in names}  # checkpoint name -> HF name
    heads = {alias[n] for n in names if ".modules_to_save." in n}
    from_dir = None
    if base_dir is not None:
        try:
            from_dir = SafetensorsReader(base_dir, skeleton, set(tied) - heads)
        except FileNotFoundError as exc:
            raise NotStreamable(str(exc)) from None
    shapes = {k.removeprefix(PEFT_PREFIX): tuple(t.shape) for k, t in wrapped.state_dict().items() if ".lora_" in k}
    lacking = {n for n in expected if from_dir is not None and n not in from_dir.files}  # heads saved without
    same = SameBase(from_dir, [alias[n] for n in names if not is_adapter(n)]) if check_base and from_dir else None
    adapters, extra = read_adapters(open_reader(tag_dir, _saved_layers(tag_dir, manifest), alias), shapes,
                                    heads | lacking, same)
    if same is not None and not same.same:  # the directory changed since the run: the checkpoint's own base
        from_dir, base_dir, extra = None, None, {n: extra[n] for n in heads}
    stats = {}
    if merge:
        lora = wrapped.peft_config[ADAPTER]
        bases = from_dir or open_reader(tag_dir, manifest, alias)
        reader = MergedReader(bases, set(tied), extra, adapters, lora.lora_alpha / lora.r, lora.fan_in_fan_out,
                              expert_wrappers(wrapped))
        stats = write_weights(reader, skeleton, out, dtype, max_bytes, str(tag_dir))
        reader.check_all_merged(str(tag_dir))
        write_metadata(skeleton, ckpt_dir / META, out, dtype, base_dir)
    if save_adapters is not None:
        if base_dir is not None:  # from_pretrained's name for the base, as PEFT records it
            wrapped.peft_config[ADAPTER].base_model_name_or_path = str(base_dir)
            hf_model = wrapped.get_base_model()
            hf_model.name_or_path = hf_model.config.name_or_path = str(base_dir)
        save_adapters(with_adapters(wrapped, adapters, {n: extra[n] for n in heads}))
    return stats


def _saved_layers(tag_dir: Path, manifest: dict) -> dict:
    """The manifest less the pipeline layers that have no file (a run whose base is a directory saves the
    layers holding adapters only)."""
    from toolkit.checkpoint.deepspeed_files import layer_file

    if manifest.get("pp", 1) == 1:
        return manifest
    hf_names = [names if (tag_dir / layer_file(i)).exists() else {}
                for i, names in enumerate(manifest["hf_names"])]
    return {**manifest, "hf_names": hf_names}


def _skeletons(config, manifest: dict):
    """(the HF model, another wrapped with the run's adapters as a PeftModel), both on the meta device."""
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import models
    from toolkit.train.lora import apply, recorded_settings

    unset_hf_deepspeed_config()  # plain skeletons, even in a process that trained under ZeRO-3
    cls = models.auto_class(manifest["task"])
    with torch.device("meta"):
        skeleton, base = (cls.from_config(config, dtype=torch.float32) for _ in range(2))
        wrapped = apply(base, recorded_settings(manifest), manifest["task"])
    return skeleton, wrapped


class SameBase:
    """Whether the directory's weights are the checkpoint's frozen ones, up to the training precision
    (bf16 rounds by at most 2^-8 of a value), on a sample of tensors seen as the checkpoint is read."""

    def __init__(self, folder: SafetensorsReader, names: list, sample: int = 8):
        shared = [n for n in names if n in folder.files]
        self.folder, self.names, self.same = folder, set(shared[:: max(1, len(shared) // sample)]), True

    def see(self, name: str, tensor) -> None:
        import torch

        if name in self.names and self.same:
            mine = self.folder.read(name).float()
            self.same = torch.allclose(tensor.float().view(mine.shape), mine, rtol=2**-7, atol=1e-6)


def read_adapters(reader, shapes: dict, wanted: set, same: SameBase | None = None) -> tuple[dict, dict]:
    """(the LoRA matrices by name without PEFT's prefix, in their shapes; the `wanted` tensors by HF
    name), one checkpoint group at a time, in fp32; `same` sees every tensor."""
    adapters, extra = {}, {}
    for group in reader.groups():
        for name, t in group.items():
            if same is not None:
                same.see(name, t)
            if name in shapes:
                adapters[name] = t.float().clone().view(shapes[name])  # pipeline masters come flat
            elif name in wanted:
                extra[name] = t.float().clone()
        del group
    return adapters, extra


def with_adapters(wrapped, adapters: dict, heads: dict):
    """The meta-device PeftModel given the adapters (and the heads it trains whole) alone: what its
    save_pretrained writes (adapter_config.json + adapter_model.safetensors)."""
    state = {PEFT_PREFIX + n: t for n, t in adapters.items()}
    for name, t in heads.items():
        module, _, leaf = name.rpartition(".")
        state[f"{PEFT_PREFIX}{module}.modules_to_save.{ADAPTER}.{leaf}"] = t
    wrapped.load_state_dict(state, strict=False, assign=True)
    return wrapped
