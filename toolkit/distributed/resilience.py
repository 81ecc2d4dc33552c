"""What a rank does when the run around it fails, so that launch.sh can restart it (--max-restarts) and a person
reads one line per rank, not a traceback:

- a section (a step, an evaluation, a checkpoint save) that runs past --step-timeout (a stuck collective, a
  hung device): Watchdog names this rank, the section and where its main thread is, then ends the rank with
  STEP_TIMEOUT, from a thread of its own (the main thread may be waiting in C, where Python runs no handler);
- another rank that died (the out-of-memory killer, a preempted node): the collective that was waiting for it
  fails (gloo: "Connection reset by peer"; NCCL: a communicator error); `peer_lost` recognises it and
  `say_peer_lost` names the rank that is gone where it ran on this host;
- a scheduler's warning before its time limit (SIGUSR1, SIGTERM) with --save-on-signal: SignalStop notes it,
  the ranks agree on it after the step (`agreed`), save, and stop.

The exit codes are launch.sh's to read: keep them equal to its PEER_LOST and STEP_TIMEOUT.
"""

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
import zlib

PEER_LOST = 75  # another rank is gone (EX_TEMPFAIL): launch.sh may restart the run
STEP_TIMEOUT = 124  # a section ran past --step-timeout (timeout(1)'s code): launch.sh may restart the run
LAUNCHER_GRACE_S = 10.0  # how long a rank that lost a peer waits for its launcher to stop it (see say_peer_lost)

_PEER_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
               "remote process exited", "NCCL Error", "ncclRemoteError", "ncclSystemError", "Socket Timeout")


class Progress:
    """Where this rank is in the run (`section`): what the watchdog and a lost peer's line name."""

    def __init__(self):
        self.section, self.since = "start-up", time.monotonic()

    @contextlib.contextmanager
    def of(self, section: str):
        previous = self.section
        self.section, self.since = section, time.monotonic()
        yield  # an error leaves the section named: where the rank was when it failed
        self.section, self.since = previous, time.monotonic()


PROGRESS = Progress()
_PEERS = []  # (host checksum, pid) of every rank by global rank, on the ranks that called know_peers


def know_peers(device) -> None:
    """Learn every rank's host and process id (one all_gather at the start), so a rank that loses a peer on its
    own host can name it."""
    import torch.distributed as dist

    from toolkit.distributed.process_group import all_gather_rows

    rows = all_gather_rows([zlib.crc32(socket.gethostname().encode()), os.getpid()], device)
    _PEERS[:] = [(int(host), int(pid)) for host, pid in rows]
    assert len(_PEERS) == dist.get_world_size()


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a collective that failed because another rank is gone."""
    import torch.distributed as dist

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError)
                                                and any(word in str(exc) for word in _PEER_WORDS)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def gone_ranks(wait_s: float = 1.0) -> list:
    """The ranks on this host whose process has ended (a zombie until its launcher reaps it). A process killed
    by a signal closes its sockets a moment before it turns into a zombie: looked at for up to `wait_s`."""
    here, deadline = zlib.crc32(socket.gethostname().encode()), time.monotonic() + wait_s
    while True:
        gone = [rank for rank, (host, pid) in enumerate(_PEERS)
                if host == here and pid != os.getpid() and not _alive(pid)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def say_peer_lost(exc: BaseException, rank: int) -> None:
    """One line for a rank whose collective failed because a peer is gone, then a short wait for the launcher
    to stop this rank (DeepSpeed's launcher reports the code of the first rank it sees ending: the dead one's
    then, the cause launch.sh names, not this PEER_LOST). Ends the process."""
    gone = gone_ranks()
    who = (f"rank {gone[0]} is gone" if len(gone) == 1 else f"ranks {gone} are gone" if gone
           else f"another rank is gone ({_first_line(exc)})")
    print(f"rank {rank}: {who} during {PROGRESS.section}: stopping", file=sys.stderr, flush=True)
    try:
        time.sleep(LAUNCHER_GRACE_S)
    except KeyboardInterrupt:  # the launcher's SIGTERM (toolkit.train's handler raises it)
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split("] ", 1)[-1][:160]  # gloo prefixes its source file: [/.../pair.cc:537] Read error ...


def where_main_thread() -> str:
    """Where the main thread is, in a few words: the collective it waits in, else its innermost frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "where is unknown"
    stack = traceback.extract_stack(frame)
    for i, entry in enumerate(stack):
        if f"torch{os.sep}distributed{os.sep}distributed_c10d.py" in entry.filename:
            caller = next((s for s in reversed(stack[:i]) if f"{os.sep}torch{os.sep}" not in s.filename
                           and f"{os.sep}deepspeed{os.sep}comm{os.sep}" not in s.filename), entry)
            return (f"waiting in torch.distributed.{entry.name} for other ranks (called from "
                    f"{_short(caller.filename)}:{caller.lineno} {caller.name})")
    last = stack[-1]
    return f"at {_short(last.filename)}:{last.lineno} {last.name}"


def _short(path: str) -> str:
    for root in ("site-packages" + os.sep, "toolkit" + os.sep, "models" + os.sep):
        if root in path:
            head = path.rsplit(root, 1)[1]
            return head if root.startswith("site") else root + head
    return path


class Watchdog:
    """Ends this rank when one section of the run's loop (PROGRESS) has lasted more than `seconds`: one line
    naming the rank, the section and where the main thread is, `before_exit()`, then exit STEP_TIMEOUT. A daemon
    thread: it acts whatever the main thread is blocked in."""

    def __init__(self, seconds: float, rank: int, before_exit=None):
        self.seconds, self.rank, self.armed, self.before_exit = float(seconds), rank, False, before_exit
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="dstk-step-timeout", daemon=True).start()

    @contextlib.contextmanager
    def section(self, what: str):
        with PROGRESS.of(what):
            self.armed = True
            try:
                yield
            finally:
                self.armed = False

    def close(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.seconds / 10)):
            ran = time.monotonic() - PROGRESS.since
            if self.armed and ran > self.seconds:
                print(f"rank {self.rank}: {PROGRESS.section} has run {ran:.0f} s, past --step-timeout "
                      f"{self.seconds:g}: {where_main_thread()}; stopping", file=sys.stderr, flush=True)
                sys.stdout.flush()
                if self.before_exit is not None:  # what must not outlive the rank (--out's lock)
                    self.before_exit()
                os._exit(STEP_TIMEOUT)


def section(watchdog: Watchdog | None, what: str):
    """`with section(watchdog, "step 5"):` a section of the loop, watched when --step-timeout is set."""
    return watchdog.section(what) if watchdog is not None else PROGRESS.of(what)


class SignalStop:
    """--save-on-signal: SIGUSR1 or SIGTERM is noted, not acted on; the loop asks `agreed` after each step and
    every rank saves and stops there together. A second SIGTERM stops the rank at once, as without the flag
    (`then`: the handler it had)."""

    SIGNALS = ("SIGUSR1", "SIGTERM")

    def __init__(self):
        self.received = None
        self.previous = {}
        for name in self.SIGNALS:
            number = getattr(signal, name)
            self.previous[number] = signal.signal(number, self._noted)

    def _noted(self, number, frame) -> None:
        if self.received is not None and number == signal.SIGTERM:
            then = self.previous.get(number)
            if callable(then):
                then(number, frame)
            return
        self.received = signal.Signals(number).name

    def agreed(self, device) -> str | None:
        """The signal any rank received (the same answer on every rank: a collective), else None."""
        from toolkit.distributed.process_group import all_reduce_sum

        index = self.SIGNALS.index(self.received) + 1 if self.received else 0
        signalled = [0.0] * len(self.SIGNALS)
        if index:
            signalled[index - 1] = 1.0
        total = all_reduce_sum(signalled, device)
        return next((name for name, count in zip(self.SIGNALS, total) if count), None)

    def restore(self) -> None:
        for number, previous in self.previous.items():
            signal.signal(number, previous)
        self.previous = {}


def crash_injected(at: int | None, step: int, last_rank: bool) -> None:
    """Testing (--crash-at-step): the last rank dies after step `at` without cleaning up (SIGKILL)."""
    if at == step and last_rank and _failing_attempt():
        os.kill(os.getpid(), signal.SIGKILL)


def fault_in_step(crash_in: int | None, stall_at: int | None, step: int, last_rank: bool) -> None:
    """Testing, inside step `step` before its work: the last rank dies (--crash-in-step) or sleeps (--stall-at-step,
    for --step-timeout)."""
    if last_rank and step in (crash_in, stall_at) and _failing_attempt():
        if step == crash_in:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)


def _failing_attempt() -> bool:
    """Testing: whether the faults above act in this launch.sh attempt (DSTK_ATTEMPT), those DSTK_FAIL_ATTEMPTS
    lists (comma-separated; default: every attempt)."""
    attempts = os.environ.get("DSTK_FAIL_ATTEMPTS")
    return not attempts or os.environ.get("DSTK_ATTEMPT", "1") in attempts.split(",")
