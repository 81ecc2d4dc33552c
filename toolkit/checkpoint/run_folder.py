"""The run folder (--out): one run per folder, never mixed, never silently lost.

    OUT/checkpoints/   DeepSpeed's tags + `latest` + dstk/ (see manifest.py)
    OUT/metrics.jsonl  one JSON line per step, then the summary
    OUT/hf/            the export at the end

A fresh run needs an empty (or missing) OUT; --resume continues the run OUT holds; --overwrite
deletes OUT's contents first (rank 0, once every rank has agreed to start).
"""

import shutil
from pathlib import Path

from toolkit.checkpoint.manifest import check_whole, read_latest
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


def check_out(out, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything is built or written, a run that would mix with or lose another."""
    out = Path(out)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                          "--overwrite deletes it; pass one")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; --out names the run's folder (checkpoints/, metrics.jsonl, hf/)")
    check_writable(out, "--out")
    if resume:
        latest = RunFolder(out).checkpoints / "latest"
        if not latest.is_file():
            raise ConfigError(f"--resume: {out} holds no checkpoint to resume (no {latest}); "
                              "drop --resume to start a fresh run there, or point --out at the run to continue")
        check_whole(latest.parent, read_latest(latest.parent))
        return
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConfigError(f"--out {out} already holds files ({shown}); pass --resume to continue that run, "
                          "--overwrite to delete it and start again, or another --out")


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
