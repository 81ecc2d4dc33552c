"""`python -m toolkit.train ...`, what launch.sh, `deepspeed --module` and torchrun start on every
rank: the same options as `dstk train`."""

import os
import signal
import sys

from toolkit.cli import main

REFUSED = (1, 2, 98)  # toolkit.cli.main's exit codes for a refusal (ConfigError, UnusableInput, PortTaken)


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


STOPPED = []  # the signal that stopped this rank (stopped()), delivered again once its clean-ups have run


def stopped(signum, frame) -> None:
    """SIGTERM (launch.sh's Ctrl-C and stop, a scheduler's preemption) as Ctrl-C: raised in the main thread, so
    `finally` blocks and `except BaseException` clean-ups run (a half-written data cache file, a temporary
    export folder), where the default action would end the process on the spot and leave them for good. The
    process still ends by the signal (end_by_signal). OUT's lock (toolkit.checkpoint.lock.RunLock) is released at
    once, even while the main thread waits in C. A second signal while the first unwinds (a launcher repeats its stop
    to the process group) is let be: raised inside the first's clean-ups it would end them with a traceback; the
    first ends the process (stop_while_in_c: by the default action after GRACE_S at the latest)."""
    if STOPPED:
        return
    STOPPED.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


stopped.graceful = True  # RunLock chains to it (its own handler otherwise ends the process at once)


def end_by_signal(signum: int) -> None:
    """End the process by `signum`'s default action, as if no handler had caught it (launchers read the cause)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def stop_while_in_c() -> None:
    """SIGTERM while the main thread waits in C (a rendezvous on a port another process holds, a collective), where
    Python runs `stopped` only once the call returns: its default action after GRACE_S. A thread reads the
    signal's number from the wakeup fd, which the C-level handler writes at once. (RunLock, once it holds --out,
    watches its own fd and gives this one back when released.)"""
    import threading

    from toolkit.checkpoint.lock import GRACE_S, end_by_default

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch():
        while data := os.read(read_end, 64):
            if signal.SIGTERM in data:
                threading.Timer(GRACE_S, end_by_default, (signal.SIGTERM,)).start()

    threading.Thread(target=watch, name="dstk-sigterm", daemon=True).start()


# A rank's stdout is a pipe under some launchers (mpirun without a pty, srun): line-buffer it so
# progress arrives as it happens and nothing is left in a buffer when MPI finalizes at exit.
sys.stdout.reconfigure(line_buffering=True)
signal.signal(signal.SIGTERM, stopped)
stop_while_in_c()
try:
    main(["train", *sys.argv[1:]])
except SystemExit as exc:
    if STOPPED:
        end_by_signal(STOPPED[0])
    if exc.code in REFUSED and os.environ.get("WORLD_SIZE", "1") != "1":
        end_rank(exc.code)
    raise
except Exception as exc:  # another rank died: one line (which one, where this rank was), not gloo's traceback
    from toolkit.distributed import resilience
    from toolkit.distributed.process_group import env_rank

    if os.environ.get("WORLD_SIZE", "1") == "1" or STOPPED or not resilience.peer_lost(exc):
        raise
    resilience.say_peer_lost(exc, env_rank())
    if STOPPED:  # the launcher stopped it meanwhile, as it stops every rank once one has ended
        end_by_signal(STOPPED[0])
    end_rank(resilience.PEER_LOST)
