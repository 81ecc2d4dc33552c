"""dstk's process group in processes of their own, started by hand: toolkit.distributed.process_group.init under launcher
variables this pytest process must not hold (its world of one, ds_world1, may be up already and would be
reused), and `python -m toolkit.train` refusing rows once its group is up (it tears the group down, as a
process entry does). Reading launcher variables: tests/unit/test_dist.py; the refusals before any group:
tests/unit/test_train_refusals.py."""

import subprocess
import sys

import pytest

from tests.conftest import child_env
from tests.unit.test_train_refusals import CORPUS, REPO, check_unusable_data, refused, train_config, write_rows


def test_an_in_process_check_is_a_world_of_one_inside_a_slurm_allocation():
    """`dstk parity` inside `sbatch -n 8` (SLURM_* set, no srun): alone=True does not wait for 7 more ranks."""
    code = ("from toolkit.distributed import process_group; d = process_group.init(cpu=True, alone=True); "
            "print(d.get_world_size(), d.get_rank()); process_group.shutdown()")
    env = child_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="8", SLURM_NODELIST="node[01-02]")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["1", "0"], result.stderr[-2000:]


def train_cli(tmp_path, *args, env=None, data=CORPUS, config=None):
    """`python -m toolkit.train ARGS` in a fresh interpreter started by hand (a world of one)."""
    cmd = [sys.executable, "-m", "toolkit.train", "--model", "tiny-gpt2", "--data", str(data),
           "--config", str(config or train_config(tmp_path)), "--out", str(tmp_path / "run"), "--seq-len", "32", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(**(env or {})), timeout=300)


# tests/unit/test_train_refusals.py: the rows refused after the process group started


@pytest.mark.parametrize("make, code, fragments", [
    (lambda d: write_rows(d / "n.jsonl", b'{"text": "ok"}\n{"text": 123}\n'), 1, ["n.jsonl row 2: 'text' is int 123, not a string"]),
    (lambda d: write_rows(d / "n1.jsonl", b'{"text": 123}\n'), 1, ["n1.jsonl row 1: 'text' is int 123, not a string"]),
    (lambda d: write_rows(d / "nt.jsonl", b'{"body": "x"}\n'), 1, ["columns ['body'] matches no format", "--text-field"]),
])
def test_unusable_data_is_refused_naming_the_file_and_the_way_out(tmp_path, make, code, fragments):
    check_unusable_data(train_cli, tmp_path, make, code, fragments)


def test_a_streaming_row_that_fails_on_the_prefetch_thread_stops_the_run_with_that_one_line(tmp_path):
    """--streaming tokenizes on a thread of its own (toolkit.data.transfer.prefetched): row 11's failure there is
    the training thread's refusal, as when it tokenized there: one line, exit 1, no traceback."""
    from tests.unit.test_data_transfer import bad_rows

    path = bad_rows(tmp_path, 10, 40)
    result = train_cli(tmp_path, "--streaming", "--steps", "4", "--eval-fraction", "0", "--no-export", data=path)
    refused(result, 1, f"{path} row 11: 'text' is missing, not a string; fix the row")
