"""DeepSpeed checkpoints written by `dstk train`: saving, `latest`, and the run's manifest beside them.

Files in CHECKPOINT_DIR:
  global_stepN/          DeepSpeed's own files: mp_rank_00_model_states.pt (+ ZeRO shards) for
                         pp = 1, layer_XX-model_states.pt per pipeline layer for pp > 1
  global_stepN/rng_state_R.pt  rank R's random-number generators (python, numpy, torch CPU and CUDA: what
                         dropout draws from), one file per global rank as the HF Trainer writes them
  latest                 the tag of the newest COMPLETE checkpoint, written by us after every rank
                         finished saving (os.replace: a run killed mid-save leaves the old one)
  dstk/                  config.json + tokenizer + manifest.json: the run's record (task, model, its
                         layout: pp, dp, tp, ZeRO stage; HF names per pipeline layer; LoRA settings...)
  global_stepN/dstk-manifest.json  the tag's own copy of the manifest (the run may have moved since)

Runs written before the manifest had its name hold dstk/layout.json and dstk-layout.json: read still.
"""

import json
import os
import re
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from toolkit.checkpoint.deepspeed_files import first_line
from toolkit.data.fingerprint import compare as compare_inputs  # (the module: `toolkit.data` would load torch)
from toolkit.distributed.agreement import agree
from toolkit.errors import ConfigError, UnusableInput
from toolkit.files import full_disk_is_one_line

META = "dstk"
MANIFEST = "manifest.json"  # in META: the run's record
TAG_MANIFEST = "dstk-manifest.json"  # a tag's own copy of the manifest (the run may have moved since)
OLD_MANIFEST, OLD_TAG_MANIFEST = "layout.json", "dstk-layout.json"  # their names in runs of older dstk: read only
TAG_FILES = "dstk-files.json"  # a tag's files and their sizes once every rank saved: what makes it whole


def save(engine, ckpt_dir: Path, step: int, frozen: bool = True, param_names=None, manifest=None,
         data_position: dict | None = None) -> str:
    """Save every rank's part under tag global_step<step>, then point `latest` at it. frozen=False
    leaves frozen parameters out (a LoRA run's base: its --model directory holds it unchanged).
    param_names: this rank's optimizer parameters by name, per group, in the order the optimizer got
    them (saved with the rank's states: what names torch's optimizer state for another layout).
    manifest: the run's manifest, also written into the tag (TAG_MANIFEST): the layout that tag has.
    data_position: this rank's place in a --streaming run's stream (DATA_POSITION), where the resumed run goes on."""
    import torch.distributed as dist

    tag = f"global_step{step}"
    client = {"step": step, "param_names": param_names}
    if (manifest or {}).get("expert_parallel"):  # AutoEP: DeepSpeed writes its own and refuses ours (engine.py:5347)
        pass
    elif (manifest or {}).get("tp", 1) == 1:  # AutoTP writes its own: how its shards make each full tensor
        client.update(universal_info())
    elif getattr(engine.module, "dstk_tp_info", None):  # tp inside pipeline stages: this stage's map
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        client[UNIVERSAL_CHECKPOINT_INFO] = engine.module.dstk_tp_info
    full = partial(full_disk_is_one_line, ckpt_dir, f"saving checkpoint {tag}", _what_is_safe(ckpt_dir))
    # each rank writes its own files (DeepSpeed's collectives come before its writes); the agreement is the
    # barrier before `latest` names the tag, and makes a full disk on any rank every rank's one line
    with agree(f"saving checkpoint {tag}"), full():
        with writes_raised_after(engine):  # its last barrier passed: an error here is agreed on, not waited for
            engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False,
                                   exclude_frozen_parameters=not frozen)
        save_rng(Path(ckpt_dir) / tag, dist.get_rank())  # DeepSpeed keeps the client state of dp rank 0 only
        if data_position is not None:
            from toolkit.files import write_text

            write_text(json.dumps(data_position), str(Path(ckpt_dir) / tag / DATA_POSITION.format(dist.get_rank())),
                       force=True)
    with agree(f"recording checkpoint {tag}", name_ranks=False), full():
        if dist.get_rank() == 0:
            if manifest is not None:
                (Path(ckpt_dir) / tag / TAG_MANIFEST).write_text(json.dumps(manifest, indent=1))
            write_file_list(Path(ckpt_dir) / tag)
            write_latest(ckpt_dir, tag)
    return tag


@contextmanager
def writes_raised_after(engine):
    """DeepSpeed's save_checkpoint ends in a barrier after its writes (runtime/engine.py), so a write that raises
    on one rank (a full disk) would leave the others waiting there. Its checkpoint engine's save and makedirs
    (every file DeepSpeed writes: states, ZeRO partitions, pipeline layers) keep the first error and skip the
    writes after it; the error is raised once save_checkpoint has returned, past its barrier."""
    ce, errors = engine.checkpoint_engine, []
    own = {name: vars(ce).get(name) for name in ("save", "makedirs")}

    def kept(write):
        def call(*args, **kwargs):
            if errors:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (raised below)
                errors.append(exc)
        return call

    for name in own:
        setattr(ce, name, kept(getattr(ce, name)))
    try:
        yield
    finally:
        for name, value in own.items():
            if value is None:
                delattr(ce, name)  # the class's method again
            else:
                setattr(ce, name, value)
    if errors:
        raise errors[0]


def _what_is_safe(ckpt_dir: Path) -> str:
    """What a save that failed leaves whole: the tag `latest` names (the new one it never names), or none."""
    latest = read_latest(ckpt_dir)
    if latest is None:
        return "no whole checkpoint was written yet: free space, then start the run again"
    return (f"the last whole checkpoint is {Path(ckpt_dir) / latest} (`latest` still names it): free space, then "
            f"--resume, or export it with `dstk export {Path(ckpt_dir).parent} OUT_DIR`")


def write_file_list(tag_dir: Path) -> None:
    """Record the tag's files (relative path -> bytes), written by every rank, before `latest` names it."""
    files = {str(f.relative_to(tag_dir)): f.stat().st_size for f in sorted(tag_dir.rglob("*"))
             if f.is_file() and f.name != TAG_FILES}
    tmp = tag_dir / f".{TAG_FILES}.{os.getpid()}"
    tmp.write_text(json.dumps(files, indent=0))
    os.replace(tmp, tag_dir / TAG_FILES)


def missing_files(tag_dir: Path) -> list[str]:
    """What the tag lacks of the files it was saved with: deleted, or cut short (a tag from an older
    dstk, without the record, is taken as whole)."""
    try:
        files = json.loads((tag_dir / TAG_FILES).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        return [f"{TAG_FILES} cannot be read ({exc})"]
    if not isinstance(files, dict) or not all(isinstance(n, int) for n in files.values()):
        return [f"{TAG_FILES} is not the list of files dstk writes (damaged)"]
    problems = []
    for name, size in files.items():
        path = tag_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, not the {size} it was saved with")
    return problems


def check_whole(ckpt_dir: Path, tag: str) -> None:
    """Refuse to resume from a tag whose files are not all there, naming them and the whole tags."""
    problems = missing_files(Path(ckpt_dir) / tag)
    if not problems:
        return
    tags = sorted((d.name for d in Path(ckpt_dir).iterdir() if d.is_dir() and re.fullmatch(r"global_step\d+", d.name)),
                  key=step_of)
    whole = [t for t in tags if t != tag and not missing_files(Path(ckpt_dir) / t)]
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    fix = (f"whole checkpoints: {', '.join(whole)}; to resume from {whole[-1]}, write {whole[-1]} into "
           f"{Path(ckpt_dir) / 'latest'}" if whole else "no other checkpoint here is whole; start the run again")
    raise UnusableInput(f"--resume: checkpoint {tag} (step {step_of(tag)}) in {ckpt_dir} is not whole: {shown}; "
                        f"{fix}")


RNG_STATE = "rng_state_{}.pt"  # per global rank
DATA_POSITION = "data_position_{}.json"  # per global rank, --streaming runs: toolkit.data.stream's position


def load_data_position(tag_dir: Path, rank: int) -> dict:
    """The stream position rank `rank` saved in the tag; a refusal when it saved none."""
    from toolkit.errors import UnusableInput

    path = Path(tag_dir) / DATA_POSITION.format(rank)
    if not path.is_file():
        raise UnusableInput(f"--resume --streaming: {tag_dir} holds no stream position for rank {rank} ({path.name}): "
                            "it was not saved by a --streaming run; resume it without --streaming")
    return json.loads(path.read_text())


def save_rng(tag_dir: Path, rank: int) -> None:
    """Write this rank's generators into the tag, atomically (a rank killed mid-write leaves no file)."""
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # plain data: a pickled array would need numpy's classes
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]  # keys: 624 uint32
    state = {"python": random.getstate(), "numpy": numpy_state, "cpu": torch.get_rng_state(),
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

    from toolkit.checkpoint import safe_load

    path = tag_dir / RNG_STATE.format(rank)
    if not path.is_file():
        return False
    state = safe_load.load(path)  # an older dstk's file holds numpy's state as a pickled array: allowed there
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
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
    """`latest` as rank 0 reads it, on every rank (node-local disks or caches can disagree). Rank 0's read is
    agreed on before the broadcast: a `latest` it cannot read (unreadable bytes, a folder) is every rank's
    refusal, not a broadcast the others wait in until the group's timeout."""
    import torch.distributed as dist

    from toolkit.distributed.agreement import agree

    box = [None]
    with agree("reading the checkpoint's latest", name_ranks=False):
        if dist.get_rank() == 0:
            try:
                box = [read_latest(ckpt_dir)]
            except (OSError, UnicodeDecodeError) as exc:
                raise UnusableInput(f"--resume: {Path(ckpt_dir) / 'latest'} cannot be read ({exc}); it names the "
                                    "checkpoint to resume: write a tag such as global_step100 into it") from None
    dist.broadcast_object_list(box, src=0)
    return box[0]


def step_of(tag: str) -> int:
    match = re.fullmatch(r"global_step(\d+)", tag)
    if not match:
        raise UnusableInput(f"checkpoint tag {tag!r} is not global_stepN; was it written by dstk train?")
    return int(match.group(1))


def _first_file(*paths: Path) -> Path:
    """The first of `paths` that exists, else the first (named in the error when none does)."""
    return next((p for p in paths if p.is_file()), paths[0])


def run_manifest_path(ckpt_dir: Path) -> Path:
    """CHECKPOINT_DIR/dstk/manifest.json (layout.json in runs of older dstk)."""
    meta = Path(ckpt_dir) / META
    return _first_file(meta / MANIFEST, meta / OLD_MANIFEST)


def read_manifest(ckpt_dir: Path, tag: str | None = None) -> dict:
    """The run's manifest; with `tag`, the one that tag was written with: its own copy (a run that moved
    to another layout keeps one per tag), else the run's."""
    path = run_manifest_path(ckpt_dir)
    if tag is not None:
        own = _first_file(Path(ckpt_dir) / tag / TAG_MANIFEST, Path(ckpt_dir) / tag / OLD_TAG_MANIFEST)
        path = own if own.is_file() else path
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnusableInput(f"{path} is missing: the checkpoint was not written by dstk train") from None
    except (OSError, ValueError) as exc:
        raise UnusableInput(f"{path} cannot be read: {first_line(exc)}") from None


def write_manifest(ckpt_dir: Path, manifest: dict) -> None:
    """Write the run's dstk/manifest.json atomically; an older dstk's layout.json goes (it would be stale)."""
    meta = Path(ckpt_dir) / META
    tmp = meta / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, meta / MANIFEST)
    (meta / OLD_MANIFEST).unlink(missing_ok=True)


def move_manifest(ckpt_dir: Path, manifest: dict) -> None:
    """The run continues on another layout: every tag without its own copy keeps the old manifest,
    and the run's becomes `manifest`."""
    old = run_manifest_path(ckpt_dir).read_text()
    for tag_dir in Path(ckpt_dir).glob("*/"):
        own = tag_dir / TAG_MANIFEST
        if tag_dir.name != META and tag_dir.is_dir() and not own.exists() and not (tag_dir / OLD_TAG_MANIFEST).exists():
            own.write_text(old)
    write_manifest(ckpt_dir, manifest)


def save_meta(ckpt_dir: Path, config, tokenizer, manifest: dict) -> None:
    """What export needs besides the weights: the HF config, the tokenizer, the run's manifest."""
    meta = Path(ckpt_dir) / META
    meta.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(meta)
    tokenizer.save_pretrained(meta)
    (meta / MANIFEST).write_text(json.dumps(manifest, indent=1))


def layer_of(stage_name: str, manifest: dict):
    """A pipeline stage's parameter name -> (global layer index, key in that layer's state dict), or None
    for a name that is neither. DeepSpeed names a stage's parameters "<layer>.<key>" ("3.layer.mlp.
    down_proj.weight"), and a tied module, which every stage using it holds, "tied_modules.<tie>.<key>":
    that one is read as its first layer's."""
    head, _, key = stage_name.partition(".")
    if head == "tied_modules":
        tie, _, key = key.partition(".")
        layers = manifest.get("tied", {}).get(tie)
        return (min(layers), key) if layers else None
    return (int(head), key) if head.isdigit() else None


def hf_name_of(stage_name: str, manifest: dict) -> str | None:
    """A pipeline stage's parameter name -> its HF name, through the manifest's per-layer map
    (hf_names[i]: {key in layer i's state dict: HF name}); None where the map has none."""
    found = layer_of(stage_name, manifest)
    if found is None:
        return None
    index, key = found
    hf_names = manifest["hf_names"]
    return (hf_names[index] if index < len(hf_names) else {}).get(key)


def stage_of(manifest: dict, index: int) -> int | None:
    """The pipeline stage holding layer `index` (the manifest's parts: stage s holds parts[s]..parts[s+1]);
    under "schedule" dualpipev the parts cut 2 pp stages and stage s is on pipeline rank min(s, 2 pp - 1 - s)."""
    parts = manifest.get("parts") or []
    stage = next((s for s in range(len(parts) - 1) if parts[s] <= index < parts[s + 1]), None)
    if stage is not None and manifest.get("schedule") == "dualpipev":
        return min(stage, len(parts) - 2 - stage)
    return stage


RUN_KEYS = ("model", "tokenizer", "task", "seq_len", "lora", "data")  # what a resume must match
# the layout: what may change on resume (toolkit.checkpoint.portable)
LAYOUT_KEYS = ("pp", "dp", "tp", "sp", "zero_stage", "schedule")
# what a manifest without the key means (an older dstk; sp was recorded only above 1 before)
LAYOUT_DEFAULTS = {"tp": 1, "sp": 1, "schedule": "1f1b"}


EP = "expert_parallel"  # DeepSpeed's AutoEP size, recorded only where the run has the section (absent: no AutoEP)


def layout_of(record: dict) -> dict:
    """A manifest's (or run identity's) layout keys, absent tp and sp read as 1 (None: not recorded), and the
    AutoEP size where there is one."""
    return {**{k: record.get(k, LAYOUT_DEFAULTS.get(k)) for k in LAYOUT_KEYS},
            **({EP: record[EP]} if record.get(EP) else {})}


def moved_keys(saved: dict, now: dict) -> list:
    """The layout keys whose values differ between a checkpoint's manifest and this run's (a key the
    checkpoint did not record, pp/dp/zero_stage of a very old dstk, is not compared); expert_parallel where
    either has AutoEP and they differ."""
    was, will = layout_of(saved), layout_of(now)
    ep = [EP] if saved.get(EP, 0) != now.get(EP, 0) else []
    return [k for k in LAYOUT_KEYS if was[k] is not None and was[k] != will[k]] + ep


TOKEN_KEYS = ("tokenizer", "seq_len", "data")  # what --resume-with-new-data lets change: the token stream


def check_resumable(ckpt_dir: Path, now: dict, tag: str | None = None, new_data: bool = False,
                    layout: bool = True) -> list:
    """Refuse to resume a checkpoint written with another model, task or LoRA setting, or on another token
    stream (tokenizer and its files, seq-len, data: file, format, chat template, --train-on, packing, split,
    seed) unless new_data (--resume-with-new-data), and a move to another layout that cannot be honoured
    (layout=False: not checked, e.g. by --check before the world is known); returns the layout keys that
    change (pp, dp, sp, zero_stage: the run continues there through toolkit.checkpoint.portable)."""
    saved = read_manifest(ckpt_dir, tag)
    if "task" in saved:  # a run started with `--task classification` recorded the short name
        from models import task_named

        saved = {**saved, "task": task_named(saved["task"])}
    changed, moved, _ = compare_inputs(saved, now)  # the token stream's files by content: moved is the same
    diffs = {k: _diff(k, saved[k], now.get(k), skip={*changed, *moved}) for k in RUN_KEYS if k in saved}
    if changed:
        diffs["data"] = "; ".join([*changed.values(), *filter(None, [diffs.get("data")])])
    strict = [d for k, d in diffs.items() if d and not (new_data and k in TOKEN_KEYS)]
    if strict:
        tokens = all(k in TOKEN_KEYS for k, d in diffs.items() if d)
        fix = ("pass --resume-with-new-data to continue this run's weights and optimizer on the new token stream, "
               "or resume with what the checkpoint recorded" if tokens else
               "resume with the same --model, --task and LoRA options")
        raise ConfigError(f"--resume: {ckpt_dir} was written by another run ({'; '.join(strict)}); {fix}, or start "
                          "a fresh --out")
    if not layout:
        return []
    moved = moved_keys(saved, now)
    was = ", ".join(f"{k} {v}" for k, v in layout_of(saved).items() if v is not None)
    why = None
    if moved and saved.get(EP) and saved.get("pp", 1) == 1 and not saved.get("zero_stage") and not _autoep_names(saved):
        why = ("this ZeRO-0 expert-parallel checkpoint names its optimizer's parameters as they were before AutoEP "
               "replaced them (written by an older dstk), so its torch optimizer state cannot be named")
    elif moved and max(saved.get("tp", 1), now.get("tp", 1)) > 1:
        why = ("a tensor-parallel checkpoint holds each tensor in tp shards, which only `dstk export` merges "
               "today; export it and start a new run from the HF directory")
    elif moved and not saved.get("portable"):
        why = "the checkpoint was written by an older dstk that did not name its optimizer states"
    if why:
        raise ConfigError(f"--resume: {ckpt_dir} was written with {was} and this run has "
                          f"{', '.join(f'{k} {v}' for k, v in layout_of(now).items())}: {why}; resume with the "
                          "checkpoint's layout (its config), or start a fresh --out")
    return moved


def _autoep_names(saved: dict) -> bool:
    """Whether the manifest's param_groups are an AutoEP engine's (recorded after initialize: its experts named)."""
    from models.autoep import EXPERT

    return any(EXPERT.fullmatch(name) for group in saved.get("param_groups") or [] for name in group)


def _diff(key: str, saved, now, skip=()) -> str:
    """`key: checkpoint A, now B`, or "" when they agree. A group of settings (data) is compared on the keys
    the checkpoint recorded (an older dstk recorded fewer), naming only the ones that differ. `skip`: dotted keys
    compared by content instead (fingerprint.compare), and the fingerprints themselves ("data.content")."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return "; ".join(f"{key}.{k}: checkpoint {saved[k]!r}, now {now.get(k)!r}" for k in sorted(saved)
                         if saved[k] != now.get(k) and k != "content" and f"{key}.{k}" not in skip)
    return f"{key}: checkpoint {saved!r}, now {now!r}" if saved != now and key not in skip else ""


def resume_notes(saved: dict, now: dict, new_data: bool = False) -> list:
    """What a resume accepted that its user should read: an input at another path with the same content, a checkpoint
    whose inputs' content could not be checked, new content taken on purpose (--resume-with-new-data)."""
    changed, moved, notes = compare_inputs(saved, now)
    taken = [f"{said} (--resume-with-new-data)" for said in changed.values()] if new_data else []
    return [*moved.values(), *notes, *taken]


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
