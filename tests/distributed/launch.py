"""Run a script or `dstk train` on CPU ranks on gloo, forked from the warm rank server (tests/ranks.py)."""

from tests.ranks import run_ranks


def run_script(script, *args, num_procs=2, timeout=600, env=None, cwd=None):
    """`python SCRIPT ARGS` on `num_procs` ranks of one world, as `deepspeed --num_gpus N` would start it
    (without the --local_rank argument, which the rank reads from LOCAL_RANK); raises if a rank fails."""
    kwargs = {"cwd": cwd} if cwd else {}
    rc, log = run_ranks([script, *args], num_procs, env=env, timeout=timeout, **kwargs)
    if rc:
        raise AssertionError(f"{script} {' '.join(map(str, args))} on {num_procs} ranks exited {rc}:\n{log[-6000:]}")
    return log
