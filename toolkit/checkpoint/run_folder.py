"""The run folder (--out): one run per folder, never mixed, never silently lost.

    OUT/checkpoints/   DeepSpeed's tags + `latest` + dstk/ (see manifest.py)
    OUT/metrics.jsonl  one JSON line per step, then the summary
    OUT/hf/            the export at the end
    OUT/recipe.yaml    the flags the run was started with (`--recipe OUT/recipe.yaml --resume` continues it)

A fresh run needs an empty (or missing) OUT; --resume continues the run OUT holds; --overwrite
deletes OUT's contents first (rank 0, once every rank has agreed to start).
"""

import shutil
from pathlib import Path

from toolkit.checkpoint.manifest import check_whole, read_latest, step_of
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
        self.trackers = self.out / "trackers.json"  # the wandb and mlflow run ids a resumed run continues
        self.recipe = self.out / "recipe.yaml"  # the run's flags (toolkit.config.recipe.recorded)


def check_out(out, resume: bool, overwrite: bool, inputs: dict | None = None) -> None:
    """Refuse, before anything is built or written, a run that would mix with or lose another, or
    whose --overwrite would delete more than a run (`inputs`: flag -> path of what the run reads)."""
    out = Path(out)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                          "--overwrite deletes it; pass one")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; --out names the run's folder (checkpoints/, metrics.jsonl, hf/)")
    check_writable(out, "--out")
    if resume:
        check_resume_tag(RunFolder(out).checkpoints)
        return
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConfigError(f"--out {out} already holds files ({shown}); pass --resume to continue that run, "
                          "--overwrite to delete it and start again, or another --out")
    if held and overwrite:
        check_deletable(out, inputs or {})


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
    """Delete what OUT holds (not OUT itself: it may be a mount point or carry permissions)."""
    out = Path(out)
    if not out.is_dir():
        return
    for entry in out.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
