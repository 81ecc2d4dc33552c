"""One run per --out (toolkit.checkpoint.lock), on real ranks: two runs started into one folder at once, one trains
and the other is refused naming it; a run whose folder was taken after its checks is refused on every rank before it
writes anything; the lock goes when a run ends, is refused, or is stopped by SIGTERM; a killed run's lock is taken
over by the resume, which says so. The lock's own rules, --check, export and reshard: tests/unit/test_run_lock.py.

Each test: 1-2 launches of tiny-gpt2 for a few steps, ~5-15 s on 2 cores.
"""

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import COMMON, launch
from tests.ranks import run_ranks, server
from toolkit.checkpoint.lock import LOCK

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).parent / "scripts"
QUICK = ["--no-export", "--eval-fraction", "0"]


def in_threads(*work):
    """Run each of `work` in a thread of its own; the rank server is started here first: a process started from a
    thread dies with that thread (the server's PR_SET_PDEATHSIG follows the thread that forked it)."""
    server()
    threads = [threading.Thread(target=w) for w in work]
    for t in threads:
        t.start()
    return threads


def steps_of(out: Path) -> list:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if "step" in r] + [-1 for r in lines if "summary" in r]


def test_two_runs_started_into_one_out_at_once_one_trains_and_the_other_is_refused(tmp_path):
    """Before: both exited 0, their checkpoints, metrics and exports mixed in one folder. The second run starts once
    the first holds the lock, and the first trains long enough (30 steps) to still hold it when the second checks:
    two runs started together on a loaded host could otherwise run one after the other (the second then refused as
    a used folder, not a folder in use)."""
    cfg = write_config(tmp_path / "ds.json", run_config(2, 2, 1))
    out, results = tmp_path / "run", [None, None]

    def start(i):
        results[i] = launch(cfg, out, 2, "--steps", 30, "--save-every", 15, *QUICK, timeout=300)

    def second():
        deadline = time.monotonic() + 240
        while not (out / LOCK).exists() and results[0] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        start(1)

    for t in in_threads(lambda: start(0), second):
        t.join()
    (won, log), (lost, said) = results
    assert won == 0, log[-3000:]
    assert lost == 1 and "Traceback" not in said, said[-3000:]
    assert len(re.findall(rf"--out {out} is in use by dstk train \(pid \d+ on host {socket.gethostname()}, started ",
                          said)) == 1, said[-3000:]
    assert f"rm {out / LOCK}" in said
    assert steps_of(out) == [*range(1, 31), -1]  # one run's steps, once, and its summary
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["dstk", "global_step15", "global_step30", "latest"]
    assert not (out / LOCK).exists()


def test_a_folder_taken_after_the_checks_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    """Rank 0 takes the lock once every rank passed its checks; another run's lock there by then is one refusal,
    printed once, on both ranks at once (no rank left waiting), and --out holds nothing of this run."""
    cfg = write_config(tmp_path / "ds.json", run_config(2, 2, 1))
    out = tmp_path / "run"
    other = subprocess.Popen(["sleep", "120"])  # the other run's rank 0
    try:
        rc, log = run_ranks([SCRIPTS / "out_taken_meanwhile.py", other.pid, "--config", cfg, *COMMON, "--steps", 2,
                             *QUICK, "--out", out], 2, timeout=120)
    finally:
        other.kill()
        other.wait()
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert log.count(f"is in use by dstk train (pid {other.pid} on host") == 1, log[-3000:]
    assert os.listdir(out) == [LOCK]  # the other run's


def test_the_lock_goes_when_a_run_ends_or_is_refused_after_taking_it(tmp_path):
    cfg = write_config(tmp_path / "ds.json", run_config(2, 2, 1))
    rc, log = launch(cfg, tmp_path / "run", 1, "--steps", 2, *QUICK)
    assert rc == 0 and not (tmp_path / "run" / LOCK).exists(), log[-3000:]
    rc, log = launch(cfg, tmp_path / "long", 1, "--steps", 2, "--seq-len", 100000, *QUICK)  # refused in the build
    assert rc == 1 and "--seq-len 100000" in log and "Traceback" not in log, log[-3000:]
    assert (tmp_path / "long").is_dir() and not (tmp_path / "long" / LOCK).exists()  # made by rank 0 holding it


def test_sigterm_releases_the_lock_and_a_killed_runs_lock_is_taken_over_by_the_resume(tmp_path):
    """SIGTERM to rank 0 mid-run: the lock goes with it (the rank still ends by SIGTERM). SIGKILL leaves the lock:
    stale (its process is gone, this host), taken over by `--resume`, which says so in one line."""
    cfg = write_config(tmp_path / "ds.json", run_config(2, 2, 1))
    out, result = tmp_path / "run", []
    [started] = in_threads(lambda: result.append(launch(cfg, out, 1, "--steps", 100000, "--save-every", 2, *QUICK,
                                                        timeout=300)))
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").is_file() and time.monotonic() < deadline and started.is_alive():
        time.sleep(0.2)
    held = json.loads((out / LOCK).read_text())
    os.kill(held["pid"], signal.SIGTERM)
    started.join()
    rc, log = result[0]
    assert rc == -signal.SIGTERM and not (out / LOCK).exists(), log[-3000:]

    killed = tmp_path / "killed"
    rc, log = launch(cfg, killed, 1, "--steps", 2, "--save-every", 1, "--crash-at-step", 1, *QUICK)
    assert rc == -signal.SIGKILL and (killed / LOCK).exists(), log[-3000:]
    pid = json.loads((killed / LOCK).read_text())["pid"]
    rc, log = launch(cfg, killed, 1, "--steps", 2, "--resume", *QUICK)
    assert rc == 0, log[-3000:]
    assert log.count(f"note: --out {killed} was locked by dstk train (pid {pid} on host ") == 1, log[-3000:]
    assert "whose process is gone; taking the lock over" in log and not (killed / LOCK).exists()
