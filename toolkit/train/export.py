"""A dstk-trained DeepSpeed checkpoint -> a HF directory (safetensors, config, tokenizer).

Pipeline checkpoints hold one file per layer (layer_XX-model_states.pt): the layout saved beside
them maps each layer's keys back to HF names. pp = 1 checkpoints hold the HF state dict itself
(ZeRO-3 as shards, gathered with DeepSpeed's zero_to_fp32).

The HF directory is written into a temporary folder beside OUT_DIR and renamed into place: a
failure leaves no half-written export, and an existing OUT_DIR is replaced only with overwrite.
"""

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput
from toolkit.files import as_umask
from toolkit.train.checkpoint import META, read_latest
from toolkit.train.hf import MODEL_TASKS
from toolkit.train.lora import PEFT_PREFIX, is_adapter


def find_checkpoint_dir(path) -> Path:
    """PATH when it is a checkpoint folder (it holds dstk/), or PATH/checkpoints when PATH is a run's --out."""
    path = Path(path)
    if (path / META).is_dir():
        return path
    if (path / "checkpoints" / META).is_dir():
        return path / "checkpoints"
    raise UnusableInput(f"{path} has no {META}/ folder: it was not written by dstk train; give the run's --out "
                        "folder or its checkpoints/ folder")


def tags(ckpt_dir: Path) -> list:
    """The checkpoint tags (folders) in CHECKPOINT_DIR, oldest step first."""
    def order(name):  # global_stepN by N, then any other name
        match = re.fullmatch(r"global_step(\d+)", name)
        return (0, int(match.group(1)), "") if match else (1, 0, name)

    names = [p.name for p in Path(ckpt_dir).iterdir() if p.is_dir() and p.name != META and not p.name.startswith(".")]
    return sorted(names, key=order)


def resolve_tag(ckpt_dir: Path, tag: str | None) -> str:
    """`tag`, or the one `latest` names; a message listing the tags there are when it is missing."""
    there = tags(ckpt_dir)
    listed = f"tags are {', '.join(there)}" if there else "it holds no tags"
    if tag is not None:
        if not (Path(ckpt_dir) / tag).is_dir():
            raise ConfigError(f"{ckpt_dir}: no tag {tag}; {listed}")
        return tag
    tag = read_latest(ckpt_dir)
    if tag is None or not (Path(ckpt_dir) / tag).is_dir():
        raise UnusableInput(f"{ckpt_dir} holds no complete checkpoint (no 'latest' file naming a tag directory); "
                            f"{listed}" + ("; pass --tag" if there else ""))
    return tag


def load_state_dict(ckpt_dir: Path, tag: str | None = None) -> tuple[dict, dict]:
    """(HF state dict in fp32, layout) from a pipeline or pp = 1 (incl. ZeRO) checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    tag = resolve_tag(ckpt_dir, tag)
    layout = _read_layout(ckpt_dir / META / "layout.json")
    if layout.get("pp", 1) > 1:
        state = {**_pipeline_state(ckpt_dir / tag, layout["hf_names"], layout.get("base_saved", True)),
                 **_pipeline_masters(ckpt_dir / tag, layout)}
    elif list((ckpt_dir / tag).glob("*_optim_states.pt")):  # ZeRO 1-3: the optimizer's fp32 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
                state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
            state = {**_frozen(ckpt_dir / tag), **state}  # a frozen base (LoRA) is not in the optimizer's files
        except (RuntimeError, EOFError, OSError, ValueError, KeyError) as exc:
            raise UnusableInput(f"{ckpt_dir / tag}: the ZeRO shards cannot be gathered ({first_line(exc)}); "
                                "the checkpoint is incomplete or damaged: export another tag with --tag") from None
    else:
        saved = _torch_load(ckpt_dir / tag / "mp_rank_00_model_states.pt")
        if not isinstance(saved, dict) or "module" not in saved:
            raise UnusableInput(f"{ckpt_dir / tag / 'mp_rank_00_model_states.pt'} holds no 'module' state dict: "
                                "not a DeepSpeed model checkpoint")
        state = {**saved["module"], **_zero0_masters(saved, layout)}
    return {k: v.float() for k, v in state.items()}, layout


def _frozen(tag_dir: Path) -> dict:
    """The module's own tensors at pp = 1 (frozen parameters are not in ZeRO's optimizer files; under
    ZeRO-3 the module holds empty placeholders, which are left out)."""
    path = tag_dir / "mp_rank_00_model_states.pt"
    saved = _torch_load(path) if path.exists() else {}
    return {k: v for k, v in (saved.get("module") or {}).items() if v.numel()}


def _zero0_masters(saved: dict, layout: dict) -> dict:
    """ZeRO-0 under bf16/fp16: the fp32 masters DeepSpeed's optimizer wrapper keeps, by name, in the
    optimizer's parameter order that training recorded (layout["param_groups"]): one tensor per
    parameter ("fp32_groups", FP16_UnfusedOptimizer: torch's AdamW) or one flat tensor per group
    ("fp32_groups_flat", FP16_Optimizer: FusedAdam on CUDA). {} without masters (fp32 training: the
    module's weights are the masters); a checkpoint that does not match the recorded order is refused."""
    optimizer = saved.get("optimizer") if isinstance(saved.get("optimizer"), dict) else {}
    names = layout.get("param_groups")
    groups = optimizer.get("fp32_groups")
    if groups is None and optimizer.get("fp32_groups_flat") is not None:
        groups = [_split(flat, [saved["module"][n].numel() for n in group_names])
                  for flat, group_names in zip(optimizer["fp32_groups_flat"], names or [])]
    if not groups or not names:
        return {}
    if [len(g) for g in groups] != [len(n) for n in names]:
        raise UnusableInput(f"the checkpoint's fp32 masters ({[len(g) for g in groups]} per group) do not match the "
                            f"parameter order training recorded ({[len(n) for n in names]}); export with --tag "
                            "another checkpoint of this run")
    return {name: master for group, group_names in zip(groups, names) for name, master in zip(group_names, group)}


def _split(flat, numels: list) -> list:
    """A flat fp32 group cut into its parameters (padding past their sum is dropped)."""
    if sum(numels) > flat.numel():
        return []
    return list(flat[: sum(numels)].split(numels))


def _read_layout(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnusableInput(f"{path} is missing: the checkpoint was not written by dstk train") from None
    except (OSError, ValueError) as exc:
        raise UnusableInput(f"{path} cannot be read: {first_line(exc)}") from None


def _torch_load(path: Path):
    """torch.load, with a one-line error for a missing, truncated or foreign file."""
    import pickle
    import zipfile

    import torch

    if not path.is_file():
        raise UnusableInput(f"{path} is missing: the checkpoint is incomplete or from another layout")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise UnusableInput(f"{path} cannot be read ({first_line(exc)}): the file is truncated or damaged "
                            "(a save cut short?); export another tag with --tag") from None


def first_line(exc: Exception) -> str:
    """The first sentence of an exception's message (torch's run to a paragraph)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line.split(". ")[0].rstrip(".")


def _pipeline_state(tag_dir: Path, hf_names: list, base_saved: bool = True) -> dict:
    """layer_XX-model_states.pt (keys relative to the layer) -> HF names via the saved layout.

    hf_names[i] is {key in layer i's state dict: HF parameter name}. base_saved False (LoRA from a
    directory): a layer without adapters has no file, and the others hold their adapters only."""
    state = {}
    for i, names in enumerate(hf_names):
        path = tag_dir / f"layer_{i:02d}-model_states.pt"
        if not names or (not path.exists() and set(names.values()) <= set(state)):
            continue  # DeepSpeed saves a tied module once, with its first layer
        if not path.exists() and not base_saved and not any(is_adapter(hf) for hf in names.values()):
            continue
        layer = _torch_load(path)
        for key, hf in names.items():
            if key in layer:  # a LoRA run's layer files may hold its adapters only
                state[hf] = layer[key]
    return state


def _pipeline_masters(tag_dir: Path, layout: dict) -> dict:
    """A pipeline trained in bf16/fp16: the fp32 masters of DeepSpeed's BF16_Optimizer, by HF name.

    Each stage s and data-parallel rank r wrote bf16_zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt:
    per parameter group a flat fp32 partition (r's share of the group), and param_slice_mappings:
    stage-module name ("3.layer.mlp.down_proj.weight", "tied_modules.embed.parts.0.weight") -> where
    its fragment starts in that partition. Fragments are put together across r in order, shaped
    like the module's weights. {} when there are no such files (fp32: the weights are the masters)."""
    files = sorted(tag_dir.glob("bf16_zero_pp_rank_*_mp_rank_*_optim_states.pt"))
    if not files:
        return {}
    by_stage = {}
    for path in files:
        dp_rank, stage = map(int, re.match(r"bf16_zero_pp_rank_(\d+)_mp_rank_(\d+)_", path.name).groups())
        by_stage.setdefault(stage, {})[dp_rank] = path
    pieces = {}  # stage-module name -> [fp32 fragments in order]
    for stage, ranks in sorted(by_stage.items()):
        for dp_rank in sorted(ranks):
            saved = _torch_load(ranks[dp_rank])["optimizer_state_dict"]
            for flat, mapping in zip(saved["single_partition_of_fp32_groups"], saved["param_slice_mappings"]):
                for name, where in mapping.items():
                    pieces.setdefault((stage, name), []).append(flat.narrow(0, where.start, where.numel))
    return _masters_by_hf_name(pieces, layout)


def _masters_by_hf_name(pieces: dict, layout: dict) -> dict:
    """{(stage, stage-module name): fragments} -> {HF name: flat fp32 tensor}. A tied module's copy is
    taken from the first layer that holds it (the same stage whose layer file export reads)."""
    hf_names, tied = layout["hf_names"], layout.get("tied", {})
    out = {}
    for (stage, name), fragments in pieces.items():
        head, _, key = name.partition(".")
        if head == "tied_modules":
            tie, _, key = key.partition(".")
            index = min(tied.get(tie, [None]) or [None])
            if index is None or not _in_stage(layout, index, stage):
                continue  # a later stage's copy of the tied weight
        elif head.isdigit():
            index = int(head)
        else:
            continue
        hf = (hf_names[index] if index < len(hf_names) else {}).get(key)
        if hf is not None:
            out[hf] = _cat(fragments)
    return out


def _in_stage(layout: dict, index: int, stage: int) -> bool:
    parts = layout.get("parts") or []
    return len(parts) > stage + 1 and parts[stage] <= index < parts[stage + 1]


def _cat(fragments: list):
    import torch

    return torch.cat(fragments) if len(fragments) > 1 else fragments[0]


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export(ckpt_dir, out_dir, tag: str | None = None, overwrite: bool = True, dtype: str = "fp32",
           adapter_dir=None, merge: bool = True) -> Path:
    """Write OUT_DIR = a HF directory (safetensors, config, tokenizer) with the checkpoint's weights.

    ckpt_dir: a checkpoint folder or the run folder holding it. overwrite=False refuses an OUT_DIR
    that already holds files (checked before anything is loaded). dtype: fp32 (the default: the
    weights as trained, masters where the checkpoint holds them) or bf16/fp16 (half the bytes);
    config.json's "dtype" says which. A LoRA run (layout["lora"]): OUT_DIR holds the adapters merged
    into full weights, and `adapter_dir` (when given) the adapters alone in PEFT's format; with
    merge=False OUT_DIR holds the adapters alone instead (no merged weights)."""
    import torch
    from transformers import AutoConfig

    import models

    ckpt_dir = find_checkpoint_dir(ckpt_dir)
    out_dir = Path(out_dir)
    _check_out(out_dir, overwrite)
    meta = ckpt_dir / META
    _check_adapter_flags(ckpt_dir, out_dir, adapter_dir, merge, bool(_read_layout(meta / "layout.json").get("lora")))
    if adapter_dir is not None:
        _check_out(Path(adapter_dir), overwrite)
    state, layout = load_state_dict(ckpt_dir, tag)
    try:
        config = AutoConfig.from_pretrained(meta)
    except (OSError, ValueError) as exc:
        raise UnusableInput(f"{meta}/config.json cannot be read as a HF config: {first_line(exc)}") from None
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    cls = models.auto_class(MODEL_TASKS[layout["task"]])
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a plain whole model, even in a process that trained under ZeRO-3
    lora = layout.get("lora") or {}
    required = bool(lora.get("qlora")) or layout.get("base_saved") is False  # the checkpoint has no usable base
    base = _lora_base(layout, cls, config, required=required) if lora and (merge or required) else None
    if base is not None and not lora.get("qlora") and not _same_base(state, base[0]):
        base = None  # the directory changed since the run: the checkpoint's own copy of the base it trained on
    if base is not None:  # the adapters merge into the exact weights the run started from
        model, absent = base
        state = {k: v for k, v in state.items() if is_adapter(k) or _base_name(k) in absent}
    else:
        model = cls.from_config(config, dtype=torch.float32)  # CPU; every weight is then overwritten
    if layout.get("lora"):
        model = _with_adapters(model, layout["lora"], layout["task"])
    shapes = model.state_dict()
    state = {k: v.view(shapes[k].shape) if k in shapes and v.dim() == 1 and shapes[k].dim() != 1 else v
             for k, v in state.items()}  # pipeline masters come flat
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _tied(model, k) and (base is None or is_adapter(k))]
    if missing or unexpected:
        raise ConfigError(f"{ckpt_dir} does not match its model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    if layout.get("lora"):
        if adapter_dir is not None or not merge:  # PEFT's adapter_config + adapter_model (+ the tokenizer)
            _write_dir_atomically(Path(adapter_dir) if merge else out_dir,
                                  lambda folder: _save_with_tokenizer(model, meta, folder))
        if not merge:
            return out_dir
        model = model.merge_and_unload()
    model.to(getattr(torch, DTYPES[dtype]))
    model.config.dtype = DTYPES[dtype]

    _write_dir_atomically(out_dir, lambda folder: _save_with_tokenizer(model, meta, folder))
    return out_dir


def _check_adapter_flags(ckpt_dir: Path, out_dir: Path, adapter_dir, merge: bool, is_lora: bool) -> None:
    if not merge and not is_lora:
        raise ConfigError(f"--no-merge: {ckpt_dir} is not a LoRA run (no adapters to write apart); export the full "
                          "model without --no-merge")
    if adapter_dir is None:
        return
    if not is_lora:
        raise ConfigError(f"--adapter-dir: {ckpt_dir} is not a LoRA run (no adapters to write); drop --adapter-dir")
    if not merge:
        raise ConfigError("--adapter-dir with --no-merge: OUT_DIR already gets the adapters alone; drop one of them")
    if Path(adapter_dir).absolute() == out_dir.absolute():
        raise ConfigError(f"--adapter-dir {adapter_dir} is OUT_DIR: the merged model would replace the adapters; "
                          "give another folder")


def _save_with_tokenizer(model, meta: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(meta).save_pretrained(folder)


def _lora_base(layout: dict, cls, config, required: bool):
    """(the run's --model directory loaded in fp32, the HF names it lacks) for a LoRA run, or None when
    there is no such directory (a built-in model, or moved) and it is not `required`.

    The base never trains, so the directory holds it exactly, while the checkpoint holds it at the
    training precision (bf16 weights rounded; QLoRA: 4 bits). Weights the directory lacks (a head it
    was saved without, initialised by the run) are taken from the checkpoint."""
    import torch
    from transformers.utils import logging as hf_logging

    path = layout.get("model")
    if not path or not Path(path).is_dir():
        if not required:
            return None
        held = "in 4 bits only (QLoRA)" if (layout.get("lora") or {}).get("qlora") else "not at all (adapters only)"
        raise UnusableInput(f"this LoRA checkpoint holds its base {held}; export merges the adapters into the "
                            f"model the run was trained from, {path!r}, which is not a directory here. Make it "
                            "available at that path (or export on the machine that has it)")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the heads the directory lacks: expected here
    try:
        model, info = cls.from_pretrained(path, config=config, dtype=torch.float32, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    return model, set(info["missing_keys"])


def _same_base(state: dict, model, sample: int = 8) -> bool:
    """Whether the directory's weights are the checkpoint's frozen ones, up to the training precision
    (bf16 rounds by at most 2^-8 of a value), on a sample of tensors."""
    import torch

    mine = model.state_dict()
    shared = [k for k in state if not is_adapter(k) and _base_name(k) in mine]
    keys = shared[:: max(1, len(shared) // sample)]  # spread over the model: first, middle and last layers
    return all(torch.allclose(state[k].float(), mine[_base_name(k)].float(), rtol=2**-7, atol=1e-6) for k in keys)


def _base_name(key: str) -> str:
    """A PeftModel state-dict name -> the HF model's (no PEFT prefix, no `.base_layer`)."""
    return key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _with_adapters(model, settings: dict, task: str):
    """The base model wrapped with the run's LoRA adapters (same names as in training's checkpoint)."""
    from toolkit.train.lora import LoraSettings, apply

    return apply(model, LoraSettings(settings["r"], settings["alpha"], settings["dropout"], tuple(settings["targets"]),
                                     bool(settings.get("qlora"))), task)


def _check_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file; OUT_DIR names the folder to write the HF model into")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} already holds files; pass --force to replace it, or give another OUT_DIR")
    parent = out_dir.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {out_dir}: directory {parent} does not exist; create it first "
                          f"(mkdir -p {parent})")


def _write_dir_atomically(out_dir: Path, write) -> None:
    """write(temp folder beside OUT_DIR), then rename it to OUT_DIR (the old one is removed only then)."""
    parent = out_dir.absolute().parent
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.dstk-", dir=parent))
    old = None
    try:
        write(tmp)
        as_umask(tmp)  # mkdtemp made it 0700
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.replace(out_dir, old / out_dir.name)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists() and (old / out_dir.name).exists():
            os.replace(old / out_dir.name, out_dir)  # put the previous export back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _tied(model, key: str) -> bool:
    """Whether `key` is a weight HF ties to another (lm_head.weight -> embeddings); a PeftModel's
    names are its HF model's behind PEFT's prefix."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied or key.removeprefix(PEFT_PREFIX) in tied
