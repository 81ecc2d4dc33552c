"""`python -m toolkit.train ...`, what launch.sh, `deepspeed --module` and torchrun start on every
rank: the same options as `dstk train`."""

import os
import sys

from toolkit.cli import main

REFUSED = (1, 2)  # toolkit.cli.main's exit codes for a refusal (ConfigError, UnusableInput)


def end_rank(code: int) -> None:
    """End a rank that refused, under a launcher: exit handlers run (logging, DeepSpeed's), output is
    flushed and MPI finalized (mpirun expects it), then os._exit skips the interpreter's teardown. Seen
    under load after every rank refused a data row: a rank aborted there ("terminate called without an
    active exception", signal 6), gloo's threads destroyed while still joinable; ranks that end this way
    (as the test suite's forked ranks always did) never did."""
    import atexit

    try:
        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# A rank's stdout is a pipe under some launchers (mpirun without a pty, srun): line-buffer it so
# progress arrives as it happens and nothing is left in a buffer when MPI finalizes at exit.
sys.stdout.reconfigure(line_buffering=True)
try:
    main(["train", *sys.argv[1:]])
except SystemExit as exc:
    if exc.code in REFUSED and os.environ.get("WORLD_SIZE", "1") != "1":
        end_rank(exc.code)
    raise
