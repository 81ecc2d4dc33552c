"""`--resume` compares the token stream's inputs by content (toolkit.data.fingerprint), on real ranks: --data edited in
place (same size) is refused naming the file and the way on, the same file moved elsewhere continues with a note;
under --streaming, by size, mtime and sampled blocks. Before, the manifest held the path alone: the edited file was
accepted (another order of rows after the resume) and the moved one refused.

Each test: 3 launches of 2 CPU ranks, tiny-gpt2 for 2-4 steps.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import CORPUS, launch

pytestmark = pytest.mark.distributed

ARGS = ["--model", "tiny-gpt2", "--seq-len", "32", "--no-progress", "--no-export", "--eval-fraction", "0"]


def steps_of(out: Path) -> list:
    return [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_data_edited_in_place_is_refused_and_the_same_data_moved_resumes(tmp_path):
    data = tmp_path / "corpus.txt"
    shutil.copy(CORPUS, data)
    cfg = write_config(tmp_path / "ds.json", run_config(2, 1, 1))
    out = tmp_path / "run"
    rc, log = launch(cfg, out, 2, "--data", data, "--steps", 2, model_args=ARGS)
    assert rc == 0, log[-3000:]
    original = data.read_bytes()
    data.write_bytes(original.replace(b"the", b"The", 1))  # one letter: the same size
    rc, log = launch(cfg, out, 2, "--data", data, "--steps", 4, "--resume", model_args=ARGS)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert log.count(f"--data {data}: its content changed since the checkpoint was written (sha256 ") == 1, log[-3000:]
    assert f"{len(original)} bytes then;" in log and "--resume-with-new-data" in log
    moved = tmp_path / "elsewhere" / "train.txt"
    moved.parent.mkdir()
    moved.write_bytes(original)
    data.unlink()
    rc, log = launch(cfg, out, 2, "--data", moved, "--steps", 4, "--resume", model_args=ARGS)
    assert rc == 0, log[-3000:]
    assert log.count(f"note: --data {moved} holds what the checkpoint read from {data} (same content): resuming on "
                     "it") == 1, log[-3000:]
    assert [s for s in steps_of(out) if s] == [1, 2, 3, 4]


def test_a_streamed_file_touched_since_is_refused_and_the_same_file_moved_resumes(tmp_path):
    data = tmp_path / "corpus.txt"
    shutil.copy(CORPUS, data)
    cfg = write_config(tmp_path / "ds.json", run_config(2, 1, 1))
    out, streaming = tmp_path / "run", [*ARGS, "--streaming"]
    rc, log = launch(cfg, out, 2, "--data", data, "--steps", 2, model_args=streaming)
    assert rc == 0, log[-3000:]
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # no byte changed: only mtime says it was written
    rc, log = launch(cfg, out, 2, "--data", data, "--steps", 4, "--resume", model_args=streaming)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert f"--data {data}: its content changed since the checkpoint was written (modified since (" in log, log[-3000:]
    moved = tmp_path / "elsewhere.txt"
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.rename(data, moved)  # mv keeps the mtime
    rc, log = launch(cfg, out, 2, "--data", moved, "--steps", 4, "--resume", model_args=streaming)
    assert rc == 0 and f"note: --data {moved} holds what the checkpoint read from {data}" in log, log[-3000:]
    assert [s for s in steps_of(out) if s] == [1, 2, 3, 4]
