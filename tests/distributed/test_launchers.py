"""The cluster launchers whose runners set no RANK/WORLD_SIZE, for real on CPU processes (gloo):
`launch.sh --launcher openmpi` (mpirun; DeepSpeed finds the ranks through mpi4py) and slurm tasks
(srun's variables set by hand: no slurm here), each against a `deepspeed`-launcher run of the same
config (the session's pp1dp2 layout, tests/distributed/conftest.py). `make test` installs OpenMPI and
mpi4py. The dry-run checks at the end start no process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env, free_port
from tests.distributed.test_train import COMMON, close, losses, summary

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI", "MV2_")  # this test process's own launcher, if any


def env(**extra) -> dict:
    clean = {k: v for k, v in child_env().items() if not k.startswith(LAUNCHER_PREFIXES)}
    return {**clean, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(REPO), **extra}


def launch_sh(*args, timeout=300):
    run = subprocess.run(["bash", str(REPO / "launch.sh"), *map(str, args)], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=timeout)
    return run.returncode, run.stdout + run.stderr


def train_args(out: Path, *extra) -> list:
    return [*COMMON, "--out", out, "--steps", STEPS, "--no-export", *extra]


def slurm_task(rank: int, **extra) -> dict:
    """srun's variables for task `rank` of 2 on one node; no RANK, no MASTER_*."""
    return env(**{"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1",
                  "SLURM_NODELIST": "localhost", **extra})


def run_tasks(cmd: list, envs: list, timeout=300) -> list:
    procs = [subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs)]


@pytest.fixture(scope="module")
def reference(train_runs):
    """dp = 2 (mbs 2, gas 2) through launch.sh under the deepspeed launcher: the session's pp1dp2 run
    (tests/distributed/conftest.py; the same COMMON flags, 20 steps of a constant learning rate, so its
    first STEPS losses are a STEPS-step run's): the losses every launcher must give, and its config."""
    ref = train_runs.get("pp1dp2")
    return ref.with_suffix(".json"), ref


@pytest.mark.distributed
def test_openmpi_launch_trains_two_distinct_ranks_like_the_deepspeed_launcher(reference, tmp_path):
    cfg, ref = reference
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    rc, log = launch_sh("--launcher", "openmpi", "--hostfile", hosts, "--master-port", free_port(), "--config", cfg,
                        "--", *train_args(tmp_path / "run", "--verbose"))
    assert rc == 0, log[-3000:]
    assert "cmd = mpirun -n 2 -hostfile" in log, log[-3000:]  # mpirun started the ranks, not DeepSpeed's launch
    assert len(summary(tmp_path / "run")["params_per_rank"]) == 2  # one world of 2, not 2 worlds of 1
    assert close(losses(tmp_path / "run"), losses(ref), range(1, STEPS + 1))


PROBE = """
import json, os, sys, torch, deepspeed.comm
from pathlib import Path
from toolkit import dist
group = dist.init(cpu=True)
total = torch.tensor([group.get_rank() + 1.0])
group.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
got = dict(rank=group.get_rank(), world=group.get_world_size(), ds_world=deepspeed.comm.get_world_size(),
           total=float(total), env={k: os.environ[k] for k in names})
Path(sys.argv[1], f"rank{group.get_rank()}.json").write_text(json.dumps(got))
dist.shutdown()
"""


def probe(folder: Path, results, ranks=2) -> list:
    """Each rank's view, from the files it wrote (a file, not stdout: what a launcher forwards of a
    rank's output is not what this checks)."""
    for rc, out in results:
        assert rc == 0, out[-3000:]
    files = sorted(folder.glob("rank*.json"))
    assert len(files) == ranks, "\n".join(out[-3000:] for _, out in results)
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


@pytest.mark.distributed
def test_slurm_tasks_form_one_world_through_dist_init(tmp_path):
    """No MASTER_ADDR: it is the node list's first host (a bracket range that resolves here); DeepSpeed's
    own comm sees the world too (without RANK it would ask MPI, which aborts under srun's variables)."""
    port = str(free_port())
    envs = [slurm_task(r, SLURM_NODELIST="127.0.0.[1-2]", MASTER_PORT=port) for r in (0, 1)]
    got = probe(tmp_path, run_tasks([sys.executable, "-c", PROBE, str(tmp_path)], envs, timeout=120))
    assert [(r["rank"], r["world"], r["ds_world"], r["total"]) for r in got] == [(0, 2, 2, 3.0), (1, 2, 2, 3.0)]
    assert [r["env"] for r in got] == [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port) for r in (0, 1)]


@pytest.mark.distributed
def test_openmpi_ranks_form_one_world_through_dist_init(tmp_path):
    """mpirun directly: ranks from mpi4py, rank 0's address from `hostname -I`, the port from MASTER_PORT."""
    port = str(free_port())
    cmd = ["mpirun", "-n", "2", "-x", "MASTER_PORT", sys.executable, "-c", PROBE, str(tmp_path)]
    root = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    got = probe(tmp_path, run_tasks(cmd, [env(MASTER_PORT=port, **root)], timeout=120))
    assert [(r["rank"], r["world"], r["ds_world"], r["total"]) for r in got] == [(0, 2, 2, 3.0), (1, 2, 2, 3.0)]
    assert {r["env"]["MASTER_PORT"] for r in got} == {port} and len({r["env"]["MASTER_ADDR"] for r in got}) == 1


@pytest.mark.distributed
def test_slurm_tasks_train_like_the_deepspeed_launcher(reference, tmp_path):
    cfg, ref = reference
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "toolkit.train", "--config", str(cfg), *map(str, train_args(out))]
    port = str(free_port())
    for rc, log in run_tasks(cmd, [slurm_task(r, MASTER_PORT=port) for r in (0, 1)]):
        assert rc == 0, log[-3000:]
    assert len(summary(out)["params_per_rank"]) == 2
    assert close(losses(out), losses(ref), range(1, STEPS + 1))


def dry_run(*args):
    return launch_sh(*args, "--dry-run", "--", "--model", "m")


def test_openmpi_and_slurm_commands_use_the_asked_launcher_even_on_one_host(tmp_path):
    cfg, hosts = tmp_path / "ds.json", tmp_path / "hosts"
    cfg.write_text("{}")
    hosts.write_text("# the nodes\nnode7 slots=2\nnode8 slots=2\n")
    rc, out = dry_run("--launcher", "openmpi", "--hostfile", hosts, "--master-port", 29555, "--config", cfg)
    assert rc == 0, out
    assert "--launcher openmpi --force_multi --no_ssh_check --master_addr node7 --master_port 29555" in out
    assert "--launcher_args -x\\ MASTER_PORT\\ -x\\ OMP_NUM_THREADS\\ -x\\ DS_ACCELERATOR --log_level" in out
    rc, out = dry_run("--launcher", "slurm", "--hostfile", hosts, "--launcher-args", "--partition gpu",
                      "--config", cfg)
    assert rc == 0, out
    assert "--launcher slurm --force_multi --no_ssh_check --master_addr node7 --launcher_args --partition\\ gpu" in out


@pytest.mark.parametrize("args, message", [
    (["--launcher", "openmpi"], "--launcher openmpi needs --hostfile"),
    (["--launcher", "openmpi", "--hostfile", "{hosts}", "--num-gpus", "2"], "drop --num-gpus/--num-nodes"),
    (["--launcher", "slurm", "--hostfile", "/nonexistent"], "--hostfile /nonexistent does not exist"),
    (["--launcher", "slurm", "--hostfile", "{hosts}", "--node-rank", "0", "--master-addr", "h"],
     "--node-rank is for one launcher per node"),
])
def test_launcher_misuse_is_refused_before_anything_starts(tmp_path, args, message):
    cfg, hosts = tmp_path / "ds.json", tmp_path / "hosts"
    cfg.write_text("{}")
    hosts.write_text("localhost slots=2\n")
    rc, out = dry_run(*[a.format(hosts=hosts) for a in args], "--config", cfg)
    assert rc == 2 and message in out, out
