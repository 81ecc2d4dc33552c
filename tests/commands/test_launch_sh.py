"""launch.sh run through bash: the deepspeed command its --dry-run prints, its own refusals of bad options,
`dstk train --check` refusing once before any rank starts, and DeepSpeed's log level with --verbose.
Bad counts and stages that do not divide the processes: test_refusals_launch.py."""

import os
import re
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import launch_sh
from tests.unit.test_train_refusals import train_config, refused

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"

# tests/unit/test_launch.py


def test_dry_run_prints_the_deepspeed_command(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = launch_sh("--num-gpus", "2", "--config", str(cfg), "--dry-run", "--", "--model", "tiny-gpt2", "--steps", "5")
    assert run.returncode == 0, run.stderr
    assert "-m deepspeed.launcher.runner " in run.stdout and " --num_gpus 2 " in run.stdout
    port = int(re.search(r" --master_port (\d+) ", run.stdout).group(1))  # drawn outside the ephemeral range
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not low <= port <= high and port >= 1024, port
    assert (f"--log_level critical --module toolkit.train --config {cfg} "
            "--model tiny-gpt2 --steps 5") in run.stdout


def test_node_rank_without_ssh_writes_a_hostfile_and_passes_the_master(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = launch_sh("--num-nodes", "2", "--num-gpus", "1", "--node-rank", "1", "--master-addr", "10.0.0.1",
                  "--master-port", "29555", "--config", str(cfg), "--dry-run", "--", "--model", "m")
    assert run.returncode == 0, run.stderr
    assert "--no_ssh --node_rank 1 --master_addr 10.0.0.1 --master_port 29555" in run.stdout
    assert "--num_gpus 1 --num_nodes 2 " in run.stdout
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
    run = launch_sh(*[a.format(cfg=cfg) for a in args])
    assert run.returncode == 2 and message in run.stderr


def recipe(tmp_path, **keys):
    """A recipe with an inline config (a fit one unless `keys` say otherwise) and --out in tmp_path."""
    import yaml

    from tests.configs import ds_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny-gpt2", "data": str(CORPUS), "seq-len": 32, "out": str(tmp_path / "run"),
                                    "config": ds_config(2, 2), **keys}))
    return path


def test_a_recipe_needs_no_config_and_the_ranks_read_it_themselves(tmp_path):
    """No --config to the ranks: a --config there would win over the recipe's (and be saved in OUT/recipe.yaml)."""
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    run = launch_sh("--num-gpus", "2", "--dry-run", "--", "--recipe", recipe(tmp_path), "--steps", "3", env=env)
    assert run.returncode == 0, run.stderr
    assert f"--module toolkit.train --recipe {tmp_path / 'run.yaml'} --steps 3" in run.stdout and "--config" not in run.stdout
    cfg = train_config(tmp_path)
    run = launch_sh("--num-gpus", "2", "--config", cfg, "--dry-run", "--", "--recipe", recipe(tmp_path), env=env)
    assert f"--module toolkit.train --config {cfg} --recipe " in run.stdout  # launch.sh's --config wins


def test_a_bad_recipe_is_refused_once_before_starting_any_rank(tmp_path):
    run = launch_sh("--num-gpus", "2", "--", "--recipe", recipe(tmp_path, seq_lenn=3),
                    env=dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path)))
    refused(run, 2, "unknown key 'seq_lenn'; did you mean --seq-len?")
    assert "spawned" not in run.stdout + run.stderr and not (tmp_path / "run").exists()


# tests/unit/test_train_refusals.py


def test_launch_sh_refuses_once_before_starting_any_rank(tmp_path):
    result = launch_sh("--num-gpus", "2", "--config", train_config(tmp_path), "--", "--model", "tiny-gpt2",
                       "--data", CORPUS, "--seq-len", "0", "--out", tmp_path / "run")
    refused(result, 2, "--seq-len")
    assert "spawned" not in result.stdout + result.stderr and not (tmp_path / "run").exists()


def test_launcher_logs_only_with_verbose(tmp_path):
    base = ["--num-gpus", "2", "--config", train_config(tmp_path), "--dry-run", "--"]
    quiet = launch_sh(*base, "--model", "m")
    loud = launch_sh(*base, "--model", "m", "--verbose")
    assert "--log_level critical --module toolkit.train" in quiet.stdout
    assert "--log_level info --module toolkit.train" in loud.stdout


@pytest.mark.parametrize("visible, gpus, expect", [("4,5,6", 2, "--include localhost:4\\,5 "), ("4,5", 2, "--include localhost:4\\,5 "),
                                                   ("", 2, "--num_gpus 2 ")])
def test_num_gpus_takes_the_gpus_a_scheduler_made_visible(tmp_path, visible, gpus, expect):
    """DeepSpeed's runner, given --num_gpus, drops CUDA_VISIBLE_DEVICES and uses GPUs 0..N-1 (other jobs' GPUs
    under an allocation of 4,5): launch.sh names the visible ones instead. DS_ACCELERATOR=cuda says "a GPU
    machine" here, where there is none (the dry run starts nothing)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cuda", CUDA_VISIBLE_DEVICES=visible)
    run = launch_sh("--num-gpus", gpus, "--config", cfg, "--dry-run", "--", "--model", "m", env=env)
    assert run.returncode == 0 and expect in run.stdout, run.stdout + run.stderr
    assert ("--num_gpus" in run.stdout) == (not visible)


def test_more_gpus_than_visible_are_refused(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cuda", CUDA_VISIBLE_DEVICES="4")
    run = launch_sh("--num-gpus", "2", "--config", cfg, "--dry-run", "--", "--model", "m", env=env)
    assert run.returncode == 2 and "--num-gpus 2, but CUDA_VISIBLE_DEVICES=4 shows 1 GPU(s); use --num-gpus 1" in run.stderr


RECORDER = """#!/bin/sh
printf '%s\\n' "$@" > "$RECORD/$(basename "$0").args"
echo 10.0.0.5  # ssh NODE hostname -I: the address DeepSpeed's runner asks node 0 for
"""


def _remote_launch(tmp_path, *launch_args):
    """launch.sh -> DeepSpeed's runner -> the command it starts for two nodes. The nodes cannot exist here:
    stand-ins for pdsh, ssh and mpirun record their arguments (what would run) and start nothing. From a
    machine without a GPU (a login node), with NCCL_SOCKET_IFNAME set and a ~/.deepspeed_env of the user's."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir(), home.mkdir()
    for name in ("pdsh", "ssh", "mpirun"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    (home / ".deepspeed_env").write_text("MY_SETTING=7\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("nodeA slots=1\nnodeB slots=1\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(PYTHON=sys.executable, PATH=f"{bin_dir}:{env['PATH']}", HOME=str(home), RECORD=str(tmp_path),
               NCCL_SOCKET_IFNAME="ib0", NCCL_DEBUG="WARN")
    run = launch_sh("--hostfile", hosts, *launch_args, "--config", train_config(tmp_path), "--", "--model", "tiny-gpt2",
                    "--data", CORPUS, "--out", tmp_path / "run", env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def test_pdsh_nodes_get_the_nccl_settings_from_a_login_node_without_gpus(tmp_path):
    _remote_launch(tmp_path)
    remote = (tmp_path / "pdsh.args").read_text()
    assert "export NCCL_SOCKET_IFNAME=ib0;" in remote and "export NCCL_DEBUG=WARN;" in remote
    assert "export MY_SETTING=7" in remote  # the user's own ~/.deepspeed_env still counts


def test_openmpi_nodes_get_the_nccl_settings_and_the_master_address(tmp_path):
    _remote_launch(tmp_path, "--launcher", "openmpi", "--master-addr", "10.1.1.1")
    remote = (tmp_path / "mpirun.args").read_text().split("\n")
    exported = {remote[i + 1] for i, arg in enumerate(remote) if arg == "-x"}
    assert {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "MASTER_ADDR"} <= exported, remote


@pytest.mark.parametrize("extra, expect, note", [
    ([], "--mca\\ btl_tcp_if_include\\ 127.0.0.0/8", False),  # the master's subnet, not DeepSpeed's eth0
    (["--launcher-args", "--mca btl_tcp_if_include ens5"], "--mca\\ btl_tcp_if_include\\ ens5", False),  # the user's
    (["--master-addr", "10.255.1.1"], "-x\\ MASTER_ADDR", True),  # a routed address: say what mpirun will use
])
def test_openmpi_tcp_goes_over_the_master_addresss_subnet(tmp_path, extra, expect, note):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    run = launch_sh("--launcher", "openmpi", "--hostfile", str(hosts), *extra, "--config", str(cfg), "--dry-run", "--",
                  "--model", "m")
    assert run.returncode == 0 and expect in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("btl_tcp_if_include") == (0 if note else 1)
    assert ("mpirun's TCP traffic uses eth0" in run.stderr) == note


@pytest.mark.skipif(any(Path(p).exists() for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")),
                    reason="a GPU driver is here: torch is asked, as it should be")
@pytest.mark.parametrize("driver", [False, True])
def test_a_machine_without_a_gpu_driver_runs_on_cpu_without_asking_torch(tmp_path, driver):
    """No NVIDIA or ROCm driver: DS_ACCELERATOR=cpu without importing torch (about 1.5 s of every launch).
    A driver (here a stand-in nvidia-smi): torch is asked, and its answer (no CUDA here) is taken."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python-recording"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{tmp_path}/python.calls"\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    if driver:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(PYTHON=str(python), PATH=f"{bin_dir}:{env['PATH']}")
    run = launch_sh("--num-gpus", 2, "--config", train_config(tmp_path), "--dry-run", "--", "--model", "tiny-gpt2",
                    env=env)
    assert run.returncode == 0 and run.stdout.startswith("DS_ACCELERATOR=cpu "), run.stdout + run.stderr
    asked = "import torch" in (tmp_path / "python.calls").read_text()
    assert asked == driver


def test_launch_sh_knows_dstk_trains_default_out():
    """A restart (--max-restarts) resumes from --out's last checkpoint: without --out, dstk train's default."""
    from toolkit.cli.train import train

    default = next(p.default for p in train.params if p.name == "out")
    assert f"out_dir=${{recipe_out:-{default}}}" in (REPO / "launch.sh").read_text()
