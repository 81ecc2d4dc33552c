"""Streaming LoRA export: the adapters merged into the base one tensor at a time, never the whole model.

    dstk export runs/lora runs/lora/hf --adapter-dir runs/lora/adapter --dtype bf16

Two passes over the checkpoint (toolkit.checkpoint.stream, about one layer in memory at a
time): the first keeps the adapters (lora_A, lora_B and a classifier head PEFT trains whole: small);
the second reads the base, from the run's --model safetensors when export takes the base from there
(toolkit.export.directory decides), else from the checkpoint, and writes each tensor (+ its adapted
linear's delta) into the shards as toolkit.export.stream does. The delta is peft's merge,
in fp32: W += transpose(B @ A, fan_in_fan_out) * alpha / r (fan_in_fan_out: GPT-2's Conv1D); for a
parameter peft adapts directly (a ParamWrapper: fused MoE experts (E, ., .), which peft targets when the
targets name gate_proj/up_proj/down_proj), its per-expert B_e @ A_e, as ParamWrapper.get_delta_weight.
Peak memory ~ one layer + the adapters. The PEFT adapter folder is saved (by the caller) from a
meta-device PeftModel holding the adapters alone.
"""

import json
from pathlib import Path

from toolkit.errors import ConfigError
from models.lora.adapters import is_adapter
from models.lora.experts import PEFT_PREFIX, base_name

ADAPTER = "default"  # the adapter name dstk's PeftModels use


def hf_name(name: str) -> str:
    """A checkpoint's name (PeftModel's, or a pipeline's) -> the HF model's: no PEFT prefix, no
    `.base_layer` (nested where peft wraps two parameters of one module: `experts.base_layer.base_layer.
    down_proj`), a head PEFT trains whole under its own name (`score.modules_to_save.default.weight`).
    An adapter keeps peft's own name (without the prefix): two wrappers of one module differ by it alone."""
    name = name.removeprefix(PEFT_PREFIX)
    if ".lora_" in name:
        return name
    parts = name.replace(f".modules_to_save.{ADAPTER}.", ".").split(".")
    return ".".join(part for part in parts if part != "base_layer")


class Delta:
    """What one peft LoRA layer adds to the HF parameter it adapts, from its lora_A and lora_B (fp32)."""

    def __init__(self, module: str, layer, fan_in_fan_out: bool):
        from peft.tuners.lora import ParamWrapper

        self.module, self.scaling = module, layer.scaling[ADAPTER]  # module: peft's name, without the prefix
        wrapper = isinstance(layer, ParamWrapper)
        self.experts = layer.num_experts if wrapper else 1
        self.swapped = wrapper and layer._did_swap_in_out_features  # experts stored (E, in, out) vs (E, out, in)
        self.fan_in_fan_out = fan_in_fan_out and not wrapper
        self.target = f"{hf_name(module)}.{layer.parameter_name if wrapper else 'weight'}"

    def __call__(self, adapters: dict):
        import torch

        down = adapters[f"{self.module}.lora_A.{ADAPTER}.weight"]  # (r * E, in)
        up = adapters[f"{self.module}.lora_B.{ADAPTER}.weight"]  # (out, r * E)
        if self.experts == 1:
            delta = (up @ down).T if self.fan_in_fan_out else up @ down  # peft's get_delta_weight, in fp32
        else:  # peft's ParamWrapper: A (E, r, in), B (out, r, E)
            down, up = down.reshape(self.experts, -1, down.shape[-1]), up.reshape(up.shape[0], -1, self.experts)
            delta = torch.einsum("o r e, e r i -> e o i" if self.swapped else "o r e, e r i -> e i o", up, down)
        return delta * self.scaling


def deltas(wrapped) -> dict:
    """{HF parameter name: [Delta, ...]} of a PeftModel (the meta-device one is enough)."""
    from peft.tuners.lora import LoraLayer

    fan_in_fan_out = wrapped.peft_config[ADAPTER].fan_in_fan_out
    out = {}
    for name, layer in wrapped.base_model.model.named_modules():
        if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
            delta = Delta(name, layer, fan_in_fan_out)
            out.setdefault(delta.target, []).append(delta)
    return out


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


class MergedReader:
    """The base tensors `bases` yields that the model saves (`keep`), + `extra` (from the checkpoint),
    with the adapters merged into the linears and expert parameters they adapt: a reader for stream.write_weights."""

    def __init__(self, bases, keep, extra: dict, adapters: dict, deltas: dict):
        self.bases, self.keep, self.extra, self.adapters, self.deltas = bases, keep, extra, adapters, deltas
        self.merged = set()  # the LoRA layers merged (each must be, once)

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
        for delta in self.deltas.get(name, []):  # (two where peft wraps a parameter twice: none in dstk's runs)
            change = delta(self.adapters)
            weight = weight.float().view(change.shape) + change  # peft: base_layer.weight.data += delta
            self.merged.add(delta.module)
        return weight

    def check_all_merged(self, where: str) -> None:
        unmerged = sorted(d.module for ds in self.deltas.values() for d in ds if d.module not in self.merged)
        if unmerged:
            raise ConfigError(f"{where}: adapters without a base weight to merge into: {unmerged[:4]}")


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
        bases = from_dir or open_reader(tag_dir, manifest, alias)
        reader = MergedReader(bases, set(tied), extra, adapters, deltas(wrapped))
        stats = write_weights(reader, skeleton, out, dtype, max_bytes, str(tag_dir))
        reader.check_all_merged(str(tag_dir))
        write_metadata(skeleton, ckpt_dir / META, out, dtype, base_dir)
    if save_adapters is not None:
        name_base(wrapped, base_dir if merge else run_base(manifest))
        save_adapters(with_adapters(wrapped, adapters, {n: extra[n] for n in heads}))
    return stats


def run_base(manifest: dict) -> Path | None:
    """The --model directory the run started from, where it still is (None: a built-in model, or moved)."""
    path = manifest.get("model")
    return Path(path) if path and Path(path).is_dir() else None


def name_base(wrapped, base_dir: Path | None) -> None:
    """Record `base_dir` as the adapters' base (PEFT's base_model_name_or_path, what AutoPeftModel loads)
    rather than the checkpoint's dstk/ folder the skeleton was read from, which holds no weights."""
    if base_dir is None:
        return
    wrapped.peft_config[ADAPTER].base_model_name_or_path = str(base_dir)
    hf_model = wrapped.get_base_model()
    hf_model.name_or_path = hf_model.config.name_or_path = str(base_dir)


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
    from models.lora.adapters import apply, recorded_settings

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
            elif ".lora_" in name:  # the run's LoRA settings, rebuilt, make no such adapter: it would be lost
                raise ConfigError(f"{name}: an adapter the run's recorded LoRA settings do not make (targets "
                                  "changed?); export the checkpoint with the dstk version that trained it")
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
