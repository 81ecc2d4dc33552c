"""The test launcher itself (tests/ranks.py): ranks forked from the warm server form one real gloo world
with the deepspeed launcher's variables, a failed rank ends the launch with its exit code, and a hung
launch fails within its timeout leaving no process behind."""

import json
import os
import time
from pathlib import Path

import pytest

from tests.ranks import RankTimeout, run_ranks

pytestmark = pytest.mark.distributed

PROBE = """
import json, os, sys, time, torch
from pathlib import Path
from toolkit.distributed import process_group
group = process_group.init(cpu=True)
total = torch.tensor([group.get_rank() + 1.0])
group.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT")
Path(sys.argv[1], f"rank{group.get_rank()}.json").write_text(json.dumps(dict(
    pid=os.getpid(), total=float(total), threads=torch.get_num_threads(), env={k: os.environ[k] for k in names})))
print(f"rank {group.get_rank()} done", flush=True)
mode = sys.argv[2]
if mode == "fail" and group.get_rank() == 1:
    sys.exit(3)
if mode == "hang" and group.get_rank() == 0:
    time.sleep(600)
process_group.shutdown()
"""


def _probe(tmp_path: Path, mode: str, nprocs: int = 2, timeout: float = 120):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return run_ranks([script, tmp_path, mode], nprocs, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_forked_ranks_form_one_world_with_the_deepspeed_launchers_variables(tmp_path):
    rc, log = _probe(tmp_path, "ok", nprocs=3)
    assert rc == 0, log[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [g["total"] for g in got] == [6.0] * 3 and len({g["pid"] for g in got}) == 3
    port = got[0]["env"]["MASTER_PORT"]
    assert [g["env"] for g in got] == [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="3", LOCAL_SIZE="3", CROSS_RANK="0",
                                            CROSS_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(3)]
    assert all(g["threads"] == 1 for g in got)  # OMP_NUM_THREADS=1, as the launches here set it
    assert sorted(log.splitlines()) == ["rank 0 done", "rank 1 done", "rank 2 done"]  # whole lines, each once


def test_a_failed_rank_ends_the_launch_with_its_exit_code(tmp_path):
    start = time.monotonic()
    rc, log = _probe(tmp_path, "fail")
    assert rc == 3 and time.monotonic() - start < 60, log[-3000:]  # rank 0, left waiting in shutdown, was killed
    assert not any(_alive(json.loads(f.read_text())["pid"]) for f in tmp_path.glob("rank*.json"))


def test_a_hung_launch_fails_within_its_timeout_and_leaves_no_process(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankTimeout, match="ran past 10 s") as failure:
        _probe(tmp_path, "hang", timeout=10)
    assert time.monotonic() - start < 30
    assert "rank 0 done" in str(failure.value)  # the output so far comes with the failure
    pids = [json.loads(f.read_text())["pid"] for f in tmp_path.glob("rank*.json")]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    assert os.getpid() not in pids
