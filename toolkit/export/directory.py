"""A dstk-trained DeepSpeed checkpoint -> a HF directory (safetensors, config, tokenizer).

A full model is streamed (toolkit.export.stream over toolkit.checkpoint.stream): about
one layer in memory at a time, written into sharded safetensors + index. A LoRA run is streamed too
(toolkit.export.lora_merge: the adapters merged into each base tensor as it is read, from the run's
--model safetensors or the checkpoint). What the readers do not cover (tensor parallelism, frozen
weights under ZeRO-3, a --model directory without safetensors, a model whose saved names
transformers converts, e.g. fused MoE experts) takes the whole-model path: the tensors by HF name
from toolkit.checkpoint.state are loaded into the model (a LoRA run's into the PeftModel,
whose adapters are written in PEFT's format and merged), then save_pretrained.

The HF directory is written into a temporary folder beside OUT_DIR and renamed into place: a
failure leaves no half-written export, and an existing OUT_DIR is replaced only with overwrite.
"""

import os
import shutil
import tempfile
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput
from toolkit.files import as_umask, check_writable, full_disk_is_one_line
from toolkit.checkpoint.deepspeed_files import first_line
from toolkit.checkpoint.manifest import META, read_manifest
from toolkit.checkpoint.run_folder import check_not_in_use
from toolkit.checkpoint.state import find_checkpoint_dir, load_state_dict
from models.lora.adapters import is_adapter
from models.lora.experts import PEFT_PREFIX, base_name

__all__ = ["export", "find_checkpoint_dir", "first_line", "load_state_dict"]  # the last three: toolkit.checkpoint's


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export(ckpt_dir, out_dir, tag: str | None = None, overwrite: bool = True, dtype: str = "fp32",
           adapter_dir=None, merge: bool = True, max_shard_size="5GB", stream: bool = True) -> Path:
    """Write OUT_DIR = a HF directory (safetensors, config, tokenizer) with the checkpoint's weights.

    ckpt_dir: a checkpoint folder or the run folder holding it. overwrite=False refuses an OUT_DIR
    that already holds files (checked before anything is loaded). dtype: fp32 (the default: the
    weights as trained, masters where the checkpoint holds them) or bf16/fp16 (half the bytes);
    config.json's "dtype" says which. max_shard_size: "5GB", "500MB" or bytes; a larger model is
    split into model-0000k-of-0000n.safetensors + model.safetensors.index.json.

    A full model or a LoRA merge is streamed (stream.py, lora_merge.py: about one layer in memory
    at a time); stream=False, or a checkpoint the streaming readers do not cover, load the whole
    model and save_pretrained it. A LoRA run (manifest["lora"]): OUT_DIR holds the adapters merged
    into full weights, and `adapter_dir` (when given) the adapters alone in PEFT's format; with
    merge=False OUT_DIR holds the adapters alone instead (no merged weights)."""
    from toolkit.checkpoint.safe_load import check_tag
    from toolkit.checkpoint.state import resolve_tag
    from toolkit.export.stream import parse_size

    ckpt_dir = find_checkpoint_dir(ckpt_dir)
    out_dir = Path(out_dir)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    _check_out(out_dir, overwrite)
    _check_apart(out_dir, ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    check_adapter_flags(ckpt_dir, out_dir, adapter_dir, merge, bool(manifest.get("lora")))
    if adapter_dir is not None:
        _check_out(Path(adapter_dir), overwrite)
    check_tag(ckpt_dir / resolve_tag(ckpt_dir, tag))  # a class outside DeepSpeed's in any of its files: refused
    safe = (f"{out_dir} is as it was (an export is written beside it and renamed into place) and the checkpoint "
            f"is whole: free space, then `dstk export {ckpt_dir.parent} {out_dir}`")
    with full_disk_is_one_line(out_dir.absolute().parent, f"writing the export {out_dir}", safe):
        if stream and _streamed(ckpt_dir, tag, manifest, out_dir, dtype, max_bytes, adapter_dir, merge):
            return out_dir
        return _export_in_memory(ckpt_dir, out_dir, tag, dtype, adapter_dir, merge, max_bytes)


def _streamed(ckpt_dir: Path, tag, manifest: dict, out_dir: Path, dtype: str, max_bytes: int, adapter_dir,
              merge: bool) -> bool:
    """Whether the streaming export wrote OUT_DIR (False: this checkpoint needs the whole model)."""
    from toolkit.checkpoint.state import resolve_tag
    from toolkit.checkpoint.stream import NotStreamable
    from toolkit.export.lora_merge import export_lora_streaming
    from toolkit.export.stream import export_streaming

    tag = resolve_tag(ckpt_dir, tag)
    config = _read_config(ckpt_dir / META)
    lora = manifest.get("lora")
    base_dir = None
    if lora and merge:  # the adapters merge into the exact weights the run started from, where they still are
        base_dir = _lora_base_dir(manifest, required=bool(lora.get("qlora")) or manifest.get("base_saved") is False)
    def save_adapters(folder: Path):  # PEFT's adapter folder (+ the tokenizer), from the model given
        return lambda model: write_dir_atomically(folder, lambda tmp: _save_with_tokenizer(model, meta, tmp))

    meta = ckpt_dir / META

    try:
        if not lora:
            write_dir_atomically(out_dir, lambda folder: export_streaming(ckpt_dir, tag, manifest, config, folder,
                                                                           DTYPES[dtype], max_bytes))
        elif merge:
            write_dir_atomically(out_dir, lambda folder: export_lora_streaming(
                ckpt_dir, tag, manifest, config, folder, DTYPES[dtype], max_bytes, base_dir,
                None if adapter_dir is None else save_adapters(Path(adapter_dir)), check_base=not lora.get("qlora")))
        else:  # the adapters alone into OUT_DIR
            export_lora_streaming(ckpt_dir, tag, manifest, config, None, DTYPES[dtype], max_bytes, None,
                                  save_adapters(out_dir), merge=False)
    except NotStreamable:
        return False
    return True


def _read_config(meta: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(meta)
    except (OSError, ValueError) as exc:
        raise UnusableInput(f"{meta}/config.json cannot be read as a HF config: {first_line(exc)}") from None


def _export_in_memory(ckpt_dir: Path, out_dir: Path, tag, dtype: str, adapter_dir, merge: bool, max_bytes: int) -> Path:
    """The whole model in fp32 in this process, then save_pretrained (LoRA runs; the reference the
    streaming export is tested against)."""
    import torch

    import models

    meta = ckpt_dir / META
    state, manifest = load_state_dict(ckpt_dir, tag)
    config = _read_config(meta)
    cls = models.auto_class(manifest["task"])
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a plain whole model, even in a process that trained under ZeRO-3
    lora = manifest.get("lora") or {}
    base = None
    if lora and merge:  # the adapters merge into the exact weights the run started from, where they still are
        required = bool(lora.get("qlora")) or manifest.get("base_saved") is False  # no usable base in the checkpoint
        base = _lora_base(manifest, cls, config, required=required)
        if base is not None and not lora.get("qlora") and not _same_base(state, base[0]):
            base = None  # the directory changed since the run: the checkpoint's own copy of the base it trained on
    adapters_only = base is not None or (lora and not merge)
    if adapters_only:
        model, absent = base if base is not None else (cls.from_config(config, dtype=torch.float32), set())
        state = {k: v for k, v in state.items() if is_adapter(k) or _base_name(k) in absent}
    else:
        model = cls.from_config(config, dtype=torch.float32)  # CPU; every weight is then overwritten
    if lora:
        from toolkit.export.lora_merge import name_base, run_base

        model = _with_adapters(model, manifest)
        name_base(model, run_base(manifest) if not merge or base is not None else None)
    shapes = model.state_dict()
    state = {k: v.view(shapes[k].shape) if k in shapes and v.dim() == 1 and shapes[k].dim() != 1 else v
             for k, v in state.items()}  # pipeline masters come flat
    missing, unexpected = model.load_state_dict(_without_tied_copies(model, state), strict=False)
    missing = [k for k in missing if not _tied(model, k) and (not adapters_only or is_adapter(k))]
    if missing or unexpected:
        raise ConfigError(f"{ckpt_dir} does not match its model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    if lora:
        if adapter_dir is not None or not merge:  # PEFT's adapter_config + adapter_model (+ the tokenizer)
            write_dir_atomically(Path(adapter_dir) if merge else out_dir,
                                  lambda folder: _save_with_tokenizer(model, meta, folder))
        if not merge:
            return out_dir
        model = model.merge_and_unload()
    model.to(getattr(torch, DTYPES[dtype]))
    model.config.dtype = DTYPES[dtype]

    write_dir_atomically(out_dir, lambda folder: _save_with_tokenizer(model, meta, folder, max_bytes))
    return out_dir


def check_adapter_flags(ckpt_dir: Path, out_dir: Path, adapter_dir, merge: bool, is_lora: bool) -> None:
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


def _save_with_tokenizer(model, meta: Path, folder: Path, max_bytes: int | None = None) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" per save: export says what it wrote
    model.save_pretrained(folder, **({"max_shard_size": max_bytes} if max_bytes else {}))
    AutoTokenizer.from_pretrained(meta).save_pretrained(folder)


def _lora_base(manifest: dict, cls, config, required: bool):
    """(the run's --model directory loaded in fp32, the HF names it lacks) for a LoRA run, or None when
    there is no such directory (a built-in model, or moved) and it is not `required`.

    The base never trains, so the directory holds it exactly, while the checkpoint holds it at the
    training precision (bf16 weights rounded; QLoRA: 4 bits). Weights the directory lacks (a head it
    was saved without, initialised by the run) are taken from the checkpoint."""
    import torch
    from transformers.utils import logging as hf_logging

    path = _lora_base_dir(manifest, required)
    if path is None:
        return None
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the heads the directory lacks: expected here
    try:
        model, info = cls.from_pretrained(path, config=config, dtype=torch.float32, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    return model, set(info["missing_keys"])


def _lora_base_dir(manifest: dict, required: bool) -> Path | None:
    """The run's --model directory, or None where there is none here (a built-in model, or moved) and
    it is not `required` (refused then: the checkpoint holds no usable base)."""
    path = manifest.get("model")
    if path and Path(path).is_dir():
        return Path(path)
    if not required:
        return None
    held = "in 4 bits only (QLoRA)" if (manifest.get("lora") or {}).get("qlora") else "not at all (adapters only)"
    raise UnusableInput(f"this LoRA checkpoint holds its base {held}; export merges the adapters into the "
                        f"model the run was trained from, {path!r}, which is not a directory here. Make it "
                        "available at that path (or export on the machine that has it)")


def _same_base(state: dict, model, sample: int = 8) -> bool:
    """Whether the directory's weights are the checkpoint's frozen ones, up to the training precision
    (bf16 rounds by at most 2^-8 of a value), on a sample of tensors."""
    import torch

    mine = model.state_dict()
    shared = [k for k in state if not is_adapter(k) and _base_name(k) in mine]
    keys = shared[:: max(1, len(shared) // sample)]  # spread over the model: first, middle and last layers
    return all(torch.allclose(state[k].float(), mine[_base_name(k)].float(), rtol=2**-7, atol=1e-6) for k in keys)


def _base_name(key: str) -> str:
    """A PeftModel state-dict name -> the HF model's (no PEFT prefix, no `.base_layer`, nested ones included)."""
    return base_name(key)


def _with_adapters(model, manifest: dict):
    """The base model wrapped with the run's LoRA adapters (same names as in training's checkpoint)."""
    from models.lora.adapters import apply, recorded_settings

    return apply(model, recorded_settings(manifest), manifest["task"])


def _check_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file; OUT_DIR names the folder to write the HF model into")
    check_not_in_use(out_dir, "OUT_DIR")  # e.g. RUN/hf while RUN trains: its own export would replace it
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} already holds files; pass --force to replace it, or give another OUT_DIR")
    parent = out_dir.absolute().parent
    check_writable(out_dir, "OUT_DIR", beside=True)  # a file above it, or a place this process cannot write
    if not parent.is_dir():
        raise ConfigError(f"cannot write {out_dir}: directory {parent} does not exist; create it first "
                          f"(mkdir -p {parent})")


def _check_apart(out_dir: Path, ckpt_dir: Path) -> None:
    """OUT_DIR replaces what it holds: never the checkpoint being read, nor a folder holding it."""
    out, ckpt = out_dir.resolve(), ckpt_dir.resolve()
    if out == ckpt or out in ckpt.parents or ckpt in out.parents:
        raise ConfigError(f"OUT_DIR {out_dir} would replace the checkpoint it is exported from ({ckpt_dir}); give "
                          "OUT_DIR a folder of its own, e.g. RUN/hf_again")


def write_dir_atomically(out_dir: Path, write) -> None:
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


def _without_tied_copies(model, state: dict) -> dict:
    """`state` less a tied weight's second name (lm_head.weight) where its first is there too: both
    would load into one tensor, the later winning, and at ZeRO-0 under bf16 the second is the
    module's bf16 copy while the first holds the fp32 master."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {lm_head.weight: transformer.wte.weight}
    prefix = PEFT_PREFIX if any(k.startswith(PEFT_PREFIX) for k in state) else ""
    return {k: v for k, v in state.items()
            if not (k.removeprefix(prefix) in tied and prefix + tied[k.removeprefix(prefix)] in state)}


def _tied(model, key: str) -> bool:
    """Whether `key` is a weight HF ties to another (lm_head.weight -> embeddings); a PeftModel's
    names are its HF model's behind PEFT's prefix."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied or key.removeprefix(PEFT_PREFIX) in tied
