"""Every causal LM type whose checkpoints transformers converts (MoE experts fused in memory but stored one
tensor per expert, renamed modules, ...): a tiny model saved by save_pretrained loads per stage bit-identically
to from_pretrained, and the streamed export writes exactly what save_pretrained wrote (issue 40, item 1).

For each model_type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES with a conversion (models.weights.conversion.converts:
transformers' mapping less prefix changes), the tiny model of bench/arch_sweep_config.py is saved; then
- every module a pipeline stage loads (models.pipeline_layers(dir).hf_names, through DirSource.module) holds
  the same parameters and persistent buffers as from_pretrained's model, torch.equal and in the same dtype;
  types dstk refuses to run are still listed, and what their layer list leaves out (or the whole model, when
  it cannot be listed) is loaded a top-level module at a time, so every tensor of the model is checked;
- toolkit.export.stream.write_weights, fed from_pretrained's tensors a stage module at a time, writes the
  saved model.safetensors' keys, shapes and values.
Types the sweep cannot build tiny here (CANNOT_RUN) are skipped with the reason; types without a conversion
are skipped (save_pretrained writes their in-memory names, which the rest of the suite covers). ~15 s.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from arch_sweep_config import CANNOT_RUN, build_tiny, causal_lm_class, tiny_config  # noqa: E402


def _causal_lm_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def saved_tiny(model_type: str, folder: Path) -> Path:
    """The tiny model of `model_type` saved by save_pretrained in `folder`; skipped when it cannot be
    built here or when transformers stores it under its in-memory names."""
    from models.weights.conversion import converts

    try:
        cls, config = causal_lm_class(tiny_config(model_type))
        with torch.device("meta"):
            skeleton = cls._from_config(config)
    except Exception as exc:  # noqa: BLE001  (the sweep's known cases; any other is this test's failure)
        if model_type in CANNOT_RUN:
            pytest.skip(f"{model_type}: {CANNOT_RUN[model_type]} ({type(exc).__name__})")
        raise
    if not converts(skeleton):
        pytest.skip(f"{model_type}: no conversion mapping (its checkpoints hold the in-memory names)")
    build_tiny(model_type).save_pretrained(folder)
    return folder


def stage_modules(path: Path, hf) -> tuple:
    """(the HF names a pipeline stage loads from `path`, in layer order; the names of top-level modules
    and loose tensors that load what those leave out): for a type dstk refuses, what it cannot list."""
    import models
    from toolkit.errors import ConfigError

    try:
        names = list(dict.fromkeys(n for layer in models.pipeline_layers(str(path)).hf_names for n in layer))
    except ConfigError:
        names = []
    held = {id(t) for n in names for t in hf.get_submodule(n).state_dict(keep_vars=True).values()}
    rest = [u for u in _top_level(hf) if any(id(t) not in held for t in _tensors(hf, u))]
    return names, rest


def _top_level(hf) -> list:
    """The model a module at a time: the base model's children (a layer list item by item), the other
    children of the CausalLM, then tensors held directly by either; a tied LM head is its embedding."""
    prefix, out = hf.base_model_prefix, []
    for owner, where in ((hf.get_submodule(prefix), f"{prefix}."), (hf, "")):
        for name, child in owner.named_children():
            if owner is hf and name == prefix:
                continue
            if isinstance(child, torch.nn.ModuleList):
                out += [f"{where}{name}.{i}" for i in range(len(child))]
            elif not (child is hf.get_output_embeddings() and _tied(hf)):
                out.append(f"{where}{name}")
        out += [f"{where}{n}" for n in owner.state_dict(keep_vars=True) if "." not in n]  # loose tensors
    return out


def _tied(hf) -> bool:
    return hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


def _tensors(hf, name: str) -> list:
    if name in dict(hf.named_parameters()) or name in hf.state_dict():
        return [hf.get_parameter_or_buffer(name)]
    return list(hf.get_submodule(name).state_dict(keep_vars=True).values())


def loaded_differences(path: Path, hf, names: list) -> tuple:
    """([what a DirSource over `path` loads differently from `hf` for each of `names`], ids of the tensors
    of `hf` compared)."""
    from transformers import AutoConfig

    import models
    from models.weights.source import DirSource

    config = AutoConfig.from_pretrained(path)
    source = DirSource(str(path), models.auto_class("causal-lm", config), config)
    bad, seen = [], set()
    for name in names:
        whole = name not in hf.state_dict()
        got = source.module(name).state_dict() if whole else {"": source.parameter(name)}
        want = hf.get_submodule(name).state_dict(keep_vars=True) if whole else {"": hf.get_parameter_or_buffer(name)}
        if set(got) != set(want):
            bad.append(f"{name}: keys {sorted(set(got) ^ set(want))}")
        for key in set(got) & set(want):
            seen.add(id(want[key]))
            if got[key].dtype != want[key].dtype or not torch.equal(got[key], want[key].detach()):
                bad.append(f"{name}.{key}".rstrip("."))
    return bad, seen


class StateReader:
    """A toolkit.checkpoint.stream reader over a model's state dict, a group per module name given (what a
    pipeline checkpoint's layer files yield), each tensor once."""

    def __init__(self, model, names):
        self.groups_ = []
        for name in names:
            if name in model.state_dict():  # a loose tensor
                self.groups_.append({name: model.get_parameter_or_buffer(name).detach()})
            else:
                state = model.get_submodule(name).state_dict(keep_vars=True)
                self.groups_.append({f"{name}.{k}": t.detach() for k, t in state.items()})

    def names(self) -> list:
        return list(dict.fromkeys(n for g in self.groups_ for n in g))

    def groups(self):
        done = set()
        for group in self.groups_:
            yield {n: t for n, t in group.items() if n not in done}
            done.update(group)


def exported_differences(path: Path, hf, names: list, out: Path) -> list:
    """What write_weights, fed `hf`'s tensors group by group, writes otherwise than `path`'s model.safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.export.stream import write_weights

    with torch.device("meta"):  # as export_streaming builds it
        skeleton = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    out.mkdir()
    write_weights(StateReader(hf, names), skeleton, out, "float32", 5 * 10**9, str(path))
    saved, written = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    bad = [f"only saved: {sorted(set(saved) - set(written))[:6]}"] if set(saved) - set(written) else []
    bad += [f"only written: {sorted(set(written) - set(saved))[:6]}"] if set(written) - set(saved) else []
    return bad + [f"{k} differs" for k in set(saved) & set(written) if not torch.equal(saved[k], written[k])]


@pytest.mark.parametrize("model_type", _causal_lm_types())
def test_a_saved_checkpoint_loads_per_stage_as_from_pretrained_and_exports_as_saved(model_type, tmp_path):
    path = saved_tiny(model_type, tmp_path / "saved")
    cls, _ = causal_lm_class(tiny_config(model_type))
    hf = cls.from_pretrained(path).eval()
    names, rest = stage_modules(path, hf)
    bad, seen = loaded_differences(path, hf, names + rest)
    unchecked = [n for n, t in hf.state_dict(keep_vars=True).items() if id(t) not in seen]
    assert not bad and not unchecked, f"{model_type}: per-stage loading != from_pretrained: {bad[:8]}; " \
        f"not loaded by any module: {unchecked[:6]}"
    assert names or rest
    exported = exported_differences(path, hf, names + rest, tmp_path / "exported")
    assert not exported, f"{model_type}: the streamed export != save_pretrained: {exported[:8]}"
