"""How the tests start processes: a script or `dstk train` on CPU ranks on gloo, forked from the warm rank
server (tests/ranks.py), or through the real launch.sh (the deepspeed launcher, mpirun, srun's tasks).

    launch(cfg, out, 2, "--steps", 4)            # dstk train on 2 forked ranks, launch.sh's checks first
    launch_sh("--num-gpus", "2", "--config", cfg, "--", *COMMON, "--out", out)  # the real launcher
    run_script(script, out, num_procs=2)         # python SCRIPT ARGS on 2 forked ranks
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.ranks import run_ranks, run_train

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
COMMON = ["--model", "tiny-gpt2", "--data", str(CORPUS), "--seq-len", "32", "--no-progress"]
# launch.sh's environment for training runs: CPU ranks, one thread each, this repository on the path
ENV = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))


def run_script(script, *args, num_procs=2, timeout=600, env=None, cwd=None):
    """`python SCRIPT ARGS` on `num_procs` ranks of one world, as `deepspeed --num_gpus N` would start it
    (without the --local_rank argument, which the rank reads from LOCAL_RANK); raises if a rank fails."""
    kwargs = {"cwd": cwd} if cwd else {}
    rc, log = run_ranks([script, *args], num_procs, env=env, timeout=timeout, **kwargs)
    if rc:
        raise AssertionError(f"{script} {' '.join(map(str, args))} on {num_procs} ranks exited {rc}:\n{log[-6000:]}")
    return log


def launch_sh(*args, env: dict | None = None, timeout: float = 300, wait: bool = True):
    """`bash launch.sh ARGS` from the repository root, in `env` (default: this environment with PYTHON =
    this interpreter). wait: the finished run (returncode, stdout, stderr); else the started Popen, its
    stdout and stderr merged in one pipe (finish reads it)."""
    cmd = ["bash", str(REPO / "launch.sh"), *map(str, args)]
    env = dict(os.environ, PYTHON=sys.executable) if env is None else env
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def launch(cfg: Path, out: Path, procs: int, *args, launcher=(), model_args=COMMON, wait=True, timeout=300):
    """`dstk train` on `procs` ranks forked from the warm rank server (tests/ranks.py), with launch.sh's
    checks first; with `launcher` flags (or wait=False), through launch.sh and the deepspeed launcher."""
    if not launcher and wait:
        return run_train(["--config", cfg, *model_args, "--out", out, *args], procs, timeout=timeout)
    port = [] if "--master-port" in launcher else ["--master-port", free_port()]
    proc = launch_sh(*port, "--num-gpus", procs, *launcher, "--config", cfg, "--", *model_args, "--out", out, *args,
                     env=ENV, wait=False)
    return finish(proc, timeout) if wait else proc


def finish(proc, timeout=300) -> tuple:
    """(exit code, merged output) of a launch started with wait=False."""
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def run_tasks(cmd: list, envs: list, timeout=300) -> list:
    """`cmd` started once per environment in `envs` (as srun starts its tasks), all at once; [(rc, output)]."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs)]


class LazyRuns:
    """Run folders under `tmp` (runs / NAME), each launched by the subclass's `_launch(name)` the first time a
    test asks for it: a module's tests share the runs they read, and a -k selection launches only those."""

    def __init__(self, tmp: Path):
        self.tmp, self.done = tmp, set()

    def __truediv__(self, name: str) -> Path:
        if name not in self.done:
            self._launch(name)
            self.done.add(name)
        return self.tmp / name

    def _launch(self, name: str) -> None:
        raise NotImplementedError

    def launch_run(self, name: str, cfg: Path, procs: int, flags: list, model_args: list) -> None:
        """Train run NAME with `flags`; NAME_resumed: NAME's run resumed from its step 3 (its later checkpoints
        gone). It must succeed; its output is kept as NAME.log."""
        from tests.distributed.test_resume_layouts import resumed_from

        if name.endswith("_resumed"):
            resumed_from(self / name.removesuffix("_resumed"), 3, self.tmp / name)
            flags = [*flags, "--resume"]
        rc, log = launch(cfg, self.tmp / name, procs, *flags, model_args=model_args)
        assert rc == 0, f"{name}:\n{log[-4000:]}"
        (self.tmp / f"{name}.log").write_text(log)
