"""Runs that survive a lost rank, for real: launch.sh -> DeepSpeed's launcher -> 2 CPU ranks (gloo), a pipeline of
2 stages. A rank SIGKILLed mid-run (--crash-at-step: after the step; --crash-in-step), or asleep inside a step past --step-timeout
(--stall-at-step), is restarted by launch.sh --max-restarts from the last whole checkpoint and the run ends
with the uninterrupted run's losses; a rank that fails in the first step, or one step that fails twice, is not
restarted; SIGUSR1 under --save-on-signal saves the step and stops. The faults act in the launch.sh attempts
DSTK_FAIL_ATTEMPTS lists. The launch port: a taken one is one line naming --master-port; one launch.sh drew
and lost is drawn again. All of them the `heavy` tier (launchers)."""

import json
import signal
import socket
import time

import pytest

from tests.conftest import free_port
from tests.configs import run_config, write_config
from tests.distributed.launch import COMMON, ENV, finish, launch, launch_sh
from tests.distributed.test_train import CLIP, losses

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("restarts") / "pp2.json", run_config(2, 2, 2, clip=CLIP))


def restarted(config, out, *args, attempts="1", timeout=400):
    """launch.sh --max-restarts on 2 ranks; (exit code, output)."""
    proc = launch_sh("--num-gpus", 2, "--master-port", free_port(), *args[:args.index("--")], "--config", config,
                     *args[args.index("--"):], *COMMON, "--out", out, "--no-export",
                     env={**ENV, "DSTK_FAIL_ATTEMPTS": attempts}, wait=False)
    return finish(proc, timeout)


def test_a_killed_rank_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(config, tmp_path):
    rc, log = launch(config, tmp_path / "whole", 2, "--steps", 16, "--no-export")
    assert rc == 0, log[-3000:]
    rc, log = restarted(config, tmp_path / "run", "--max-restarts", 2, "--", "--steps", 16, "--save-every", 2,
                        "--crash-at-step", 5)
    assert rc == 0, log[-5000:]
    assert "Traceback" not in log and "Connection reset" not in log, log
    assert "rank 0: rank 1 is gone during step 6: stopping" in log, log
    assert "launch.sh: a rank was killed by signal 9 (SIGKILL: out of memory?)" in log, log
    assert f"launch.sh: restart 1 of 2 after a failure in step 6: resuming from {tmp_path / 'run'}/checkpoints/global_step4" \
        in log, log
    whole, again = losses(tmp_path / "whole"), losses(tmp_path / "run")
    assert sorted(again) == list(range(1, 17))
    assert all(again[step] == pytest.approx(whole[step], rel=1e-5) for step in whole), (whole, again)


def test_a_rank_that_fails_in_the_first_step_is_not_restarted(config, tmp_path):
    rc, log = restarted(config, tmp_path / "run", "--max-restarts", 2, "--", "--steps", 4, "--crash-in-step", 1)
    assert rc == 247, log[-3000:]
    assert "launch.sh: not restarted: the run failed before its first step ended" in log, log
    assert log.count("fresh run:") == 1 and "restart 1" not in log, log


def test_a_step_that_fails_twice_in_a_row_is_not_restarted_again(config, tmp_path):
    rc, log = restarted(config, tmp_path / "run", "--max-restarts", 5, "--", "--steps", 6, "--save-every", 2,
                        "--crash-at-step", 3, attempts="1,2,3,4,5,6")
    assert rc == 247, log[-3000:]
    assert "launch.sh: restart 1 of 5 after a failure in step 4" in log, log
    assert "launch.sh: not restarted: step 4 failed twice in a row" in log and "restart 2 of 5" not in log, log


def test_a_rank_stuck_in_a_step_is_named_and_the_run_restarted(config, tmp_path):
    rc, log = restarted(config, tmp_path / "run", "--max-restarts", 1, "--", "--steps", 4, "--save-every", 2,
                        "--stall-at-step", 3, "--step-timeout", 10)
    assert rc == 0, log[-5000:]
    lines = log.splitlines()
    stuck = [line for line in lines if line.startswith("rank 1: step 3 has run")]
    assert len(stuck) == 1 and "past --step-timeout 10" in stuck[0] and "fault_in_step" in stuck[0], log
    waiting = [line for line in lines if line.startswith("rank 0: step 3 has run")]
    assert len(waiting) == 1 and "waiting in torch.distributed" in waiting[0], log
    assert "launch.sh: restart 1 of 1 after a failure in step 3: resuming from" in log, log
    assert "whose process is gone" not in log  # the stopped rank 0 released --out's lock
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]


def test_sigusr1_with_save_on_signal_saves_the_step_and_stops(config, tmp_path):
    out = tmp_path / "run"
    proc = launch_sh("--num-gpus", 2, "--master-port", free_port(), "--config", config, "--", *COMMON, "--out", out,
                     "--steps", 500, "--save-every", 400, "--no-export", "--save-on-signal", env=ENV, wait=False)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    rc, log = finish(proc, 240)
    assert rc == 0, log[-3000:]
    last = max(losses(out))
    assert 2 <= last < 400 and (out / "checkpoints" / "latest").read_text().strip() == f"global_step{last}", log
    assert f"stopped by SIGUSR1 (--save-on-signal) after step {last} of 500" in log, log
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGUSR1"
    rc, log = launch(config, out, 2, "--steps", last + 1, "--resume", "--no-export")  # the checkpoint is whole
    assert rc == 0 and f"resume: from global_step{last}" in log, log[-3000:]


def test_a_taken_master_port_is_one_line_and_a_drawn_one_is_drawn_again(config, tmp_path):
    with socket.create_server(("", 0)) as held:  # another process's server on the port
        port = held.getsockname()[1]
        done = launch_sh("--num-gpus", 2, "--master-port", port, "--config", config, "--", *COMMON, "--out",
                         tmp_path / "given", "--steps", 1, "--no-export", env=ENV)
        out = done.stdout + done.stderr
        assert done.returncode == 98 and "Traceback" not in out, out
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"master port {port} is in use" in errors[0] and "--master-port" in errors[0], out
        assert "launch.sh: a rank failed" not in out, out

        done = launch_sh("--num-gpus", 2, "--config", config, "--", *COMMON, "--out", tmp_path / "drawn", "--steps",
                         1, "--no-export", env={**ENV, "DSTK_TEST_FIRST_PORT": str(port)})
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert f"note: the master port {port} that launch.sh drew was taken" in out and "error:" not in out, out
