"""Run a script under the real `deepspeed` launcher with CPU processes on gloo."""

import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def run_deepspeed(script, *args, num_procs=2, timeout=600, env=None, cwd=None):
    """`deepspeed --num_gpus N script args...` (on CPU, --num_gpus is the process count)."""
    from tests.conftest import child_env, free_port

    full_env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_procs), "--master_port", str(free_port()),
           str(script), *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if result.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
