"""launch.sh run through bash: the deepspeed command its --dry-run prints, its own refusals of bad options,
`dstk train --check` refusing once before any rank starts, and DeepSpeed's log level with --verbose.
Bad counts and stages that do not divide the processes: test_refusals_launch.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_train_refusals import train_config, refused

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"

# tests/unit/test_launch.py


def dry_run(*args):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(REPO / "launch.sh"), *args], capture_output=True, text=True, env=env, cwd=REPO)


def test_dry_run_prints_the_deepspeed_command(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = dry_run("--num-gpus", "2", "--config", str(cfg), "--dry-run", "--", "--model", "tiny-gpt2", "--steps", "5")
    assert run.returncode == 0, run.stderr
    assert "-m deepspeed.launcher.runner --num_gpus 2 --master_port " in run.stdout  # a free port
    assert (f"--log_level error --module toolkit.train --config {cfg} "
            "--model tiny-gpt2 --steps 5") in run.stdout


def test_node_rank_without_ssh_writes_a_hostfile_and_passes_the_master(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = dry_run("--num-nodes", "2", "--num-gpus", "1", "--node-rank", "1", "--master-addr", "10.0.0.1",
                  "--master-port", "29555", "--config", str(cfg), "--dry-run", "--", "--model", "m")
    assert run.returncode == 0, run.stderr
    assert "--num_nodes 2 --num_gpus 1 --no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29555" in run.stdout
    hostfile = run.stdout.split("--hostfile ")[1].split()[0]
    assert Path(hostfile).read_text() == "node0 slots=1\nnode1 slots=1\n"


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "2", "--", "--model", "m"], "--config FILE is required"),
    (["--config", "/nonexistent.json"], "does not exist"),
    (["--config", "{cfg}", "--node-rank", "0"], "--node-rank needs --master-addr"),
    (["--config", "{cfg}", "--launcher", "ssh"], "--launcher must be"),
    (["--config", "{cfg}", "--model", "m"], "unknown option --model"),
])
def test_bad_launch_options_are_refused(tmp_path, args, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = dry_run(*[a.format(cfg=cfg) for a in args])
    assert run.returncode == 2 and message in run.stderr


# tests/unit/test_train_refusals.py


def test_launch_sh_refuses_once_before_starting_any_rank(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    cmd = ["bash", str(REPO / "launch.sh"), "--num-gpus", "2", "--config", str(train_config(tmp_path)), "--",
           "--model", "tiny-gpt2", "--data", str(CORPUS), "--seq-len", "0", "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    refused(result, 2, "--seq-len")
    assert "spawned" not in result.stdout + result.stderr and not (tmp_path / "run").exists()


def test_launcher_logs_only_with_verbose(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    base = ["bash", str(REPO / "launch.sh"), "--num-gpus", "2", "--config", str(train_config(tmp_path)), "--dry-run", "--"]
    quiet = subprocess.run(base + ["--model", "m"], capture_output=True, text=True, env=env, cwd=REPO)
    loud = subprocess.run(base + ["--model", "m", "--verbose"], capture_output=True, text=True, env=env, cwd=REPO)
    assert "--log_level error --module toolkit.train" in quiet.stdout
    assert "--log_level info --module toolkit.train" in loud.stdout
