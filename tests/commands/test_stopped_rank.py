"""A rank stopped by SIGTERM (launch.sh's Ctrl-C, a scheduler's preemption) while it tokenizes leaves nothing half
written in the data cache: toolkit.train's handler raises it as Ctrl-C, so the clean-ups run (the default action
ended the process on the spot: a 157 MB temporary left in the cache for good). A fresh `python -m toolkit.train`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_while_tokenizing_leaves_no_temporary_in_the_cache(tmp_path):
    from tests.configs import ds_config, write_config

    data = tmp_path / "big.jsonl"
    with open(data, "w") as f:  # ~60 MB: tokenizing it takes tens of seconds on 2 cores
        for i in range(300_000):
            f.write(json.dumps({"text": f"document {i}: " + "some words of text " * 10}) + "\n")
    cache = tmp_path / "cache"
    cfg = write_config(tmp_path / "ds.json", ds_config(2, 1))
    from tests.conftest import DIST_ENV

    # a world of one started by hand: none of the launcher variables this test process's own group set (its port)
    env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, "DSTK_PROGRESS_SECONDS": "0.2",
           "PYTHONPATH": str(REPO)}
    for _ in range(3):  # (a world of one takes a free port for its group: another process may take it first)
        rank = subprocess.Popen([sys.executable, "-m", "toolkit.train", "--config", str(cfg), "--model", "tiny-gpt2",
                                 "--data", str(data), "--data-cache", str(cache), "--out", str(tmp_path / "run"),
                                 "--seq-len", "32", "--steps", "1"], cwd=REPO, env=env, stderr=subprocess.PIPE,
                                text=True)
        seen = ""
        deadline = time.monotonic() + 240
        while "tokenizing" not in seen and time.monotonic() < deadline and rank.poll() is None:
            seen += rank.stderr.readline()  # until the tokenizing rows/s line: under way
        if "tokenizing" in seen or "EADDRINUSE" not in seen + rank.stderr.read():
            break
    assert "tokenizing" in seen, seen[-2000:]
    time.sleep(1.0)
    rank.send_signal(signal.SIGTERM)
    rank.wait(timeout=60)
    rank.stderr.close()
    assert rank.returncode != 0
    left = [p for p in cache.rglob("*") if any(m in p.name for m in ("partial", "tmp", "incomplete"))]
    assert not left, left
