"""The run folder (--out): one run per folder, never mixed, never silently lost.

    OUT/checkpoints/   DeepSpeed's tags + `latest` + dstk/ (see manifest.py)
    OUT/metrics.jsonl  one JSON line per step, then the summary
    OUT/hf/            the export at the end
    OUT/recipe.yaml    the flags the run was started with (`--recipe OUT/recipe.yaml --resume` continues it)

    OUT/.dstk.lock     who is writing the folder now (lock.py): one run at a time

A fresh run needs an empty (or missing) OUT; --resume continues the run OUT holds; --overwrite
deletes OUT's contents first (rank 0, once every rank has agreed to start and it holds OUT's lock).
"""

import shutil
from pathlib import Path

from toolkit.checkpoint import lock
from toolkit.checkpoint.manifest import check_whole, read_latest, step_of
from toolkit.distributed.process_group import env_world_size
from toolkit.errors import ConfigError
from toolkit.files import check_writable


class RunFolder:
    """Where a run's files lie in its folder (--out): the one place their names are written."""

    def __init__(self, out):
        self.out = Path(out)
        self.checkpoints = self.out / "checkpoints"  # DeepSpeed's tags + latest + dstk/
        self.metrics = self.out / "metrics.jsonl"
        self.loss_png = self.out / "loss.png"
        self.summary = self.out / "summary.json"  # the run's whole summary (the table on stdout is the short one)
        self.hf = self.out / "hf"  # the export
        self.adapter = self.out / "adapter"  # a LoRA run's adapters, PEFT's format
        self.tensorboard = self.out / "tensorboard"  # --report-to tensorboard's event files
        self.wandb = self.out / "wandb"  # --report-to wandb's local files
        self.trackers = self.out / "trackers.json"  # the wandb and mlflow run ids a resumed run continues
        self.recipe = self.out / "recipe.yaml"  # the run's flags (toolkit.config.recipe.recorded)

    def foreign(self) -> list:
        """The names in OUT that no run writes: not one of the files above, OUT's lock, nor a temporary folder
        of an atomic write (.hf.dstk-*, .hf.old-*)."""
        own = {p.name for p in vars(self).values() if isinstance(p, Path) and p != self.out}
        return sorted(p.name for p in self.out.iterdir() if p.name not in own and not lock.is_lock_file(p.name)
                      and not (p.name.startswith(".") and (".dstk-" in p.name or ".old-" in p.name)))


def check_out(out, resume: bool, overwrite: bool, inputs: dict | None = None) -> None:
    """Refuse, before anything is built or written, a run that would mix with or lose another, or
    whose --overwrite would delete more than a run (`inputs`: flag -> path of what the run reads).
    What OUT holds (a run writing there now, its files) is judged here in one process (--check, a run of one);
    one rank of several leaves it to rank 0, which judges it holding OUT's lock (RunLock.take_on_rank0 with
    check_held): ranks looking at a folder another run is writing, or at a lock from each one's own host, could
    disagree, and a refusal on some ranks only would leave the others waiting."""
    out = Path(out)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                          "--overwrite deletes it; pass one")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; --out names the run's folder (checkpoints/, metrics.jsonl, hf/)")
    check_writable(out, "--out")
    if env_world_size() == 1:
        lock.check_free(out)  # a run writing there now (its rank 0 holds OUT/.dstk.lock)
        check_held(out, resume, overwrite, inputs)
    elif resume:
        check_resume_tag(RunFolder(out).checkpoints)  # what the resume checks (check_resumable) read


def check_held(out, resume: bool, overwrite: bool, inputs: dict | None = None) -> None:
    """What OUT holds must be what the run does there: a whole checkpoint to resume, else nothing, or what
    --overwrite may delete (a run's lock files are not the run's content)."""
    out = Path(out)
    if resume:
        check_resume_tag(RunFolder(out).checkpoints)
        return
    held = sorted(p.name for p in out.iterdir() if not lock.is_lock_file(p.name)) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConfigError(f"--out {out} already holds files ({shown}); pass --resume to continue that run, "
                          "--overwrite to delete it and start again, or another --out")
    if held and overwrite:
        check_deletable(out, inputs or {})
        foreign = RunFolder(out).foreign()
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise ConfigError(f"--out {out} --overwrite would delete {len(foreign)} file(s) no dstk run writes "
                              f"({shown}): --overwrite replaces a run folder only; move them out, or give --out a "
                              "folder of its own (e.g. runs/NAME)")


def check_not_in_use(path, flag: str) -> None:
    """Refuse writing `path` where a run another process holds writes: its run folder, or a file or folder the
    run makes in it (hf/, adapter/, checkpoints/, metrics.jsonl, ...); a folder of one's own inside it is fine."""
    path = Path(path).absolute()
    for folder in (path, *path.parents):
        held = lock.holder(folder)
        if held is None:
            continue
        inside = path.relative_to(folder).parts
        names = {p.name for key, p in vars(RunFolder(folder)).items() if key != "out"}
        if not inside or inside[0] in names:
            what = f"{inside[0]} of run folder {folder}" if inside else f"run folder {folder}"
            hint = f" (a folder of its own inside the run is fine: {folder / (inside[0] + '_copy')})" if inside else ""
            raise ConfigError(f"{flag} {path} is {what}, in use by {lock.who(held)}: that run writes there (its "
                              f"checkpoints, metrics and export). Wait for it to end, or choose another {flag}{hint}. "
                              f"If that run is over, check, then remove the lock: rm {folder / lock.LOCK}")


def check_deletable(out: Path, inputs: dict) -> None:
    """--overwrite deletes what OUT holds: never the file system's root, a home, the current folder or one
    above it, nor a folder holding what the run reads (--model, --data, --config, ...)."""
    where = out.resolve()
    here = Path.cwd().resolve()
    if where == Path(where.anchor) or where == Path.home().resolve() or where in (here, *here.parents):
        raise ConfigError(f"--out {out} --overwrite would delete everything in {where}; give --out a folder of its "
                          "own (e.g. runs/NAME)")
    for flag, path in inputs.items():
        if path and Path(path).exists() and where in (Path(path).resolve(), *Path(path).resolve().parents):
            raise ConfigError(f"--out {out} --overwrite would delete {flag} {path}, which is inside it; move it out "
                              "of --out, or give --out a folder of its own")


def check_resume_tag(ckpt_dir: Path) -> None:
    """--resume continues from the tag `latest` names: it must name one, and that tag must be whole."""
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise ConfigError(f"--resume: {ckpt_dir.parent} holds no checkpoint to resume (no {latest}); "
                          "drop --resume to start a fresh run there, or point --out at the run to continue")
    tag = read_latest(ckpt_dir)
    if not tag or not (ckpt_dir / tag).is_dir():
        tags = sorted((d.name for d in ckpt_dir.glob("global_step*") if d.is_dir() and d.name[11:].isdigit()), key=step_of)
        said = f"names {tag!r}, which is not a folder there" if tag else "is empty"
        fix = f"write one of {', '.join(tags)} into it" if tags else "start a fresh run (drop --resume)"
        raise ConfigError(f"--resume: {latest} {said}; {fix}")
    check_whole(ckpt_dir, tag)


def clear(out) -> None:
    """Delete what OUT holds (not OUT itself: it may be a mount point or carry permissions; nor its lock, held by
    the run that clears it)."""
    out = Path(out)
    if not out.is_dir():
        return
    for entry in out.iterdir():
        if entry.name == lock.LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
