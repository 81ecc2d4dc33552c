"""The launchers themselves, for real on CPU processes (gloo), one training run each: launch.sh (the
`deepspeed` launcher under it; also as two simulated nodes, one launch.sh per node), torchrun,
`launch.sh --launcher openmpi` (mpirun; DeepSpeed finds the ranks through mpi4py) and slurm tasks
(srun's variables set by hand: no slurm here). Each gives the losses of the same config's run on ranks
forked by tests/ranks.py (the session's layouts, tests/runs.py): what every other distributed test
relies on. `make test` installs OpenMPI and mpi4py. The dry-run checks at the end start no process.
These are the `heavy` tier (`make test-all`), except the dry runs.
"""

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env, free_port
from tests.configs import run_config, write_config
from tests.distributed.launch import COMMON, finish, launch, launch_sh, run_tasks
from tests.distributed.test_train import CLIP, close, losses, summary

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI", "MV2_")  # this test process's own launcher, if any


def env(**extra) -> dict:
    clean = {k: v for k, v in child_env().items() if not k.startswith(LAUNCHER_PREFIXES)}
    return {**clean, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(REPO), **extra}


def train_args(out: Path, *extra) -> list:
    return [*COMMON, "--out", out, "--steps", STEPS, "--no-export", *extra]


def slurm_task(rank: int, **extra) -> dict:
    """srun's variables for task `rank` of 2 on one node; no RANK, no MASTER_*."""
    return env(**{"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1",
                  "SLURM_NODELIST": "localhost", **extra})


@pytest.fixture(scope="module")
def reference(train_runs):
    """dp = 2 (mbs 2, gas 2) on forked ranks: the session's pp1dp2 run
    (tests/runs.py; the same COMMON flags, 20 steps of a constant learning rate, so its
    first STEPS losses are a STEPS-step run's): the losses every launcher must give, and its config."""
    ref = train_runs.get("pp1dp2")
    return ref.with_suffix(".json"), ref


@pytest.mark.heavy
def test_launch_sh_trains_like_forked_ranks_and_prints_only_dstk_lines(train_runs, tmp_path):
    """launch.sh -> deepspeed's runner -> launch.py -> 2 ranks: the forked pp2dp1 run's losses, exactly, and
    a log with rank 0's progress and table but no launcher INFO lines, no DeepSpeed prints, no warnings."""
    ref = train_runs.get("pp2dp1")
    args = [a for a in COMMON if a != "--no-progress"]
    rc, log = launch(ref.with_suffix(".json"), tmp_path / "run", 2, "--steps", 10, "--no-export",
                     launcher=["--master-port", str(free_port())], model_args=args)
    assert rc == 0, log[-3000:]
    for noise in ("[INFO]", "[WARNING]", "Warning", "[transformers]", "SEED_LAYERS", "Using topology", "c10d"):
        assert noise not in log, (noise, log[-3000:])
    assert log.count("step 10/10 loss") == 1 and log.count("summary: ") == 1, log[-3000:]
    assert log.count("launch.sh: starting the ranks") == 1, log[-3000:]  # a line while it waits
    ready = next(line for line in log.splitlines() if line.startswith("ready after "))  # where the wait went
    for phase in ("launcher", "imports", "checks", "process group", "data", "model", "engine"):
        assert f" {phase} " in ready, ready
    assert close(losses(tmp_path / "run"), losses(ref), range(1, 11), rel=1e-6)


@pytest.mark.heavy
def test_launch_sh_refuses_a_config_for_another_world_once_before_starting_a_rank(tmp_path):
    cfg = write_config(tmp_path / "pp3.json", run_config(2, 4, 3))
    rc, log = launch(cfg, tmp_path / "bad", 2, "--steps", 2, launcher=["--master-port", str(free_port())])
    assert rc != 0 and log.count("does not divide 2; use --num-gpus 3") == 1, log[-3000:]
    assert "Traceback" not in log and not (tmp_path / "bad").exists()


@pytest.mark.heavy
def test_two_simulated_nodes_train_like_one_node(train_runs, tmp_path):
    """One launch.sh per node (--num-nodes 2 --node-rank R: deepspeed's --no_ssh), one process each."""
    ref = train_runs.get("pp2dp1")
    cfg = write_config(tmp_path / "pp2.json", run_config(2, 4, 2, clip=CLIP))
    port = str(free_port())
    procs = [launch(cfg, tmp_path / "two_nodes", 1, "--steps", 10, "--no-export", wait=False,
                    launcher=["--num-nodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                              "--master-port", port]) for r in (0, 1)]
    for rc, log in [finish(p) for p in procs]:
        assert rc == 0, log[-3000:]
    assert close(losses(tmp_path / "two_nodes"), losses(ref), range(1, 11), rel=1e-6)


@pytest.mark.heavy
def test_torchrun_trains_like_forked_ranks(reference, tmp_path):
    cfg, ref = reference
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "toolkit.train", "--config", str(cfg), *map(str, train_args(out))]
    [(rc, log)] = run_tasks(cmd, [env()])
    assert rc == 0, log[-3000:]
    assert len(summary(out)["params_per_rank"]) == 2
    assert close(losses(out), losses(ref), range(1, STEPS + 1))


@pytest.mark.heavy
def test_openmpi_launch_trains_two_distinct_ranks_like_the_deepspeed_launcher(reference, tmp_path):
    cfg, ref = reference
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    run = launch_sh("--launcher", "openmpi", "--hostfile", hosts, "--master-port", free_port(), "--config", cfg,
                    "--", *train_args(tmp_path / "run", "--verbose"), env=env())
    rc, log = run.returncode, run.stdout + run.stderr
    assert rc == 0, log[-3000:]
    assert "cmd = mpirun -n 2 -hostfile" in log, log[-3000:]  # mpirun started the ranks, not DeepSpeed's launch
    assert len(summary(tmp_path / "run")["params_per_rank"]) == 2  # one world of 2, not 2 worlds of 1
    assert close(losses(tmp_path / "run"), losses(ref), range(1, STEPS + 1))


PROBE = """
import json, os, sys, torch, deepspeed.comm
from pathlib import Path
from toolkit.distributed import process_group
group = process_group.init(cpu=True)
total = torch.tensor([group.get_rank() + 1.0])
group.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
got = dict(rank=group.get_rank(), world=group.get_world_size(), ds_world=deepspeed.comm.get_world_size(),
           total=float(total), env={k: os.environ[k] for k in names})
Path(sys.argv[1], f"rank{group.get_rank()}.json").write_text(json.dumps(got))
process_group.shutdown()
"""


def probe(folder: Path, results, ranks=2) -> list:
    """Each rank's view, from the files it wrote (a file, not stdout: what a launcher forwards of a
    rank's output is not what this checks)."""
    for rc, out in results:
        assert rc == 0, out[-3000:]
    files = sorted(folder.glob("rank*.json"))
    assert len(files) == ranks, "\n".join(out[-3000:] for _, out in results)
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


@pytest.mark.heavy
@pytest.mark.parametrize("mpi", ["none", "pmix", "pmi2"])
def test_slurm_tasks_form_one_world_through_dist_init(tmp_path, mpi):
    """No MASTER_ADDR: it is the node list's first host (a bracket range that resolves here); DeepSpeed's
    own comm sees the world too (without RANK it would ask MPI, which aborts under srun's variables). The
    same with srun's MPI plugin's variables (MpiDefault=pmix or pmi2), which used to hide the slurm set-up."""
    port = str(free_port())
    plugin = {"none": lambda r: {}, "pmix": lambda r: {"PMIX_RANK": str(r)},
              "pmi2": lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "2"}}[mpi]
    envs = [slurm_task(r, SLURM_NODELIST="127.0.0.[1-2]", MASTER_PORT=port, **plugin(r)) for r in (0, 1)]
    got = probe(tmp_path, run_tasks([sys.executable, "-c", PROBE, str(tmp_path)], envs, timeout=120))
    assert [(r["rank"], r["world"], r["ds_world"], r["total"]) for r in got] == [(0, 2, 2, 3.0), (1, 2, 2, 3.0)]
    assert [r["env"] for r in got] == [dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port) for r in (0, 1)]


@pytest.mark.heavy
@pytest.mark.parametrize("master", [None, "127.0.0.1"])
def test_openmpi_ranks_form_one_world_through_dist_init(tmp_path, master):
    """mpirun directly: ranks from mpi4py, rank 0's address from `hostname -I`, the port from MASTER_PORT;
    given MASTER_ADDR (launch.sh --master-addr passes it with -x), that address and OpenMPI's variables."""
    port = str(free_port())
    cmd = ["mpirun", "-n", "2", "-x", "MASTER_PORT", *(["-x", "MASTER_ADDR"] if master else []),
           sys.executable, "-c", PROBE, str(tmp_path)]
    root = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **({"MASTER_ADDR": master} if master else {}))
    got = probe(tmp_path, run_tasks(cmd, [env(MASTER_PORT=port, **root)], timeout=120))
    assert [(r["rank"], r["world"], r["ds_world"], r["total"]) for r in got] == [(0, 2, 2, 3.0), (1, 2, 2, 3.0)]
    assert {r["env"]["MASTER_PORT"] for r in got} == {port} and len({r["env"]["MASTER_ADDR"] for r in got}) == 1
    if master:
        assert {r["env"]["MASTER_ADDR"] for r in got} == {master}


@pytest.mark.heavy
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
    run = launch_sh(*args, "--dry-run", "--", "--model", "m", env=env())
    return run.returncode, run.stdout + run.stderr


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


def processes_naming(text: str) -> list:
    """PIDs of live processes whose command line holds `text` (an --out folder no other run uses)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(l for l in (proc / "status").read_text().splitlines() if l.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if text in cmdline and "zombie" not in state:
            found.append(int(proc.name))
    return found


# launch.sh with SIGINT and SIGQUIT as a terminal's foreground job has them. A suite started in the background
# (`pytest &` from a script, nohup) hands them down ignored, and bash cannot trap a signal ignored when it started:
# launch.sh would sleep through the Ctrl-C and its ranks train on. (A wrapper that execs bash, not preexec_fn: this
# process has threads.)
AS_A_FOREGROUND_JOB = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execvp('bash', ['bash', *sys.argv[1:]])")


@pytest.mark.heavy
@pytest.mark.parametrize("how, code", [("sigterm", 143), ("ctrl-c", 130)])  # SIGINT to the PID: ctrl-c's trap
def test_a_signal_to_launch_sh_stops_every_rank_and_names_the_last_whole_checkpoint(tmp_path, how, code):
    """Ctrl-C (SIGINT to the terminal's whole process group), or SIGINT / SIGTERM to launch.sh's PID
    alone: every rank is gone within seconds, no traceback, and the last whole checkpoint is named."""
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / f"run-{how}"
    config = write_config(tmp_path / "ds.json", run_config(2, 1, 1, clip=CLIP))
    args = ["--num-gpus", 2, "--config", config, "--", *COMMON, "--out", out, "--steps", 100000,
            "--save-every", 1, "--no-export"]
    proc = subprocess.Popen([sys.executable, "-c", AS_A_FOREGROUND_JOB, str(REPO / "launch.sh"), *map(str, args)],
                            cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a terminal's process group
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 240
        while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert latest.is_file(), proc.communicate(timeout=30)
        assert len(processes_naming(str(out))) >= 2  # the ranks (and the launcher) are running
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends: every process in the foreground group
        else:
            os.kill(proc.pid, signal.SIGTERM)  # a scheduler's cancel, to launch.sh alone
        stdout, stderr = proc.communicate(timeout=20)
        gone = time.monotonic() + 5
        while processes_naming(str(out)) and time.monotonic() < gone:
            time.sleep(0.1)
        assert processes_naming(str(out)) == [], "ranks left running after launch.sh stopped"
    finally:  # a failed check leaves no run training (and checkpointing every step) behind it
        for pid in processes_naming(str(out)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            left = proc.communicate(timeout=10)
            print("launch.sh did not stop; its output:", *left, sep="\n")  # shown with the failure
    assert proc.returncode == code, stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr, stderr
    whole = latest.read_text().strip()
    assert f"the last whole checkpoint is {out / 'checkpoints' / whole}" in stderr, stderr
    assert (out / "checkpoints" / whole).is_dir()
    assert not (out / ".dstk.lock").exists()  # rank 0 released --out's lock as it stopped: `--resume` may start


@pytest.mark.heavy
def test_a_refusal_on_the_ranks_reads_as_one_message_and_a_killed_rank_is_named(tmp_path):
    """A refusal only the ranks can make (a later row of the data, read while tokenizing): rank 0's one
    message, and no [ERROR] line of DeepSpeed's launcher with the rank's command. A rank killed by a signal:
    launch.sh names the signal and the last whole checkpoint."""
    import json as jsonlib

    config = write_config(tmp_path / "ds.json", run_config(2, 1, 1, clip=CLIP))
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join([jsonlib.dumps({"text": "a fine row " * 20})] * 3 + ['{"text": 7}']) + "\n")
    args = ["--num-gpus", 2, "--config", config, "--", *COMMON[:2], "--data", data, "--seq-len", "32", "--out",
            tmp_path / "refused", "--no-export"]
    done = launch_sh(*args, env=env())
    rc, out = done.returncode, done.stdout + done.stderr
    assert rc in (1, 2) and "Traceback" not in out and "[ERROR]" not in out and "exits with return code" not in out, out
    assert sum(line.startswith("error:") for line in out.splitlines()) == 1, out

    killed = ["--num-gpus", 2, "--config", config, "--", *COMMON, "--out", tmp_path / "killed", "--steps", 6,
              "--save-every", 2, "--no-export", "--crash-at-step", 5]
    done = launch_sh(*killed, env=env())
    rc, out = done.returncode, done.stdout + done.stderr
    assert rc == 247 and "launch.sh: a rank was killed by signal 9 (SIGKILL: out of memory?)" in out, out
    assert f"the last whole checkpoint is {tmp_path / 'killed' / 'checkpoints' / 'global_step4'}" in out, out
