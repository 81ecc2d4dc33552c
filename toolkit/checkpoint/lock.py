"""One run per folder: OUT/.dstk.lock, held by whatever writes a run folder (rank 0 of `dstk train`, `dstk
reshard`) from before its first write until it ends, however it ends (return, error, Ctrl-C, SIGTERM, SIGHUP).
A second run started into a folder in use is refused before it writes anything, naming the first.

The lock is a file made atomically: a hard link to a file already written (else O_CREAT | O_EXCL), which holds
on NFS v3+, Lustre and GPFS, where flock may be node-local or missing. It says who holds it: host, boot id, pid
namespace, pid and that process's start, the time, the command. A holder on this host (same boot, same pid
namespace) whose process is gone, or is another process under the same pid, is stale: the lock is taken over,
saying so. A holder elsewhere (another node of a shared file system, another container) is never judged from
here: the refusal says how to clear it by hand.
"""

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from toolkit.errors import ConfigError

LOCK = ".dstk.lock"
LIVE, STALE, ELSEWHERE, MINE = "live", "stale", "elsewhere", "mine"


def is_lock_file(name: str) -> bool:
    """The lock and the files it is made from (LOCK.<host>.<pid>.tmp, LOCK.stale.*): not the run's content."""
    return name == LOCK or name.startswith(LOCK + ".")


def _read(path: str, default=None):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return default


def process_started(pid: int):
    """(start time in clock ticks after boot, state letter) of process `pid` from /proc; None where unknown."""
    fields = (_read(f"/proc/{pid}/stat") or "").rpartition(")")[2].split()
    return (int(fields[19]), fields[0]) if len(fields) > 19 else None


def _pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def me(what: str) -> dict:
    """What this process writes into a lock it takes."""
    started = process_started(os.getpid())
    return {"what": what, "host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_namespace(), "pid": os.getpid(), "process_start": started[0] if started else None,
            "since": time.time(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:400]}


def judge(held: dict) -> str:
    """MINE (this process), LIVE, STALE (its process is gone) or ELSEWHERE (another host, boot or container:
    not judged from here)."""
    here = me("")
    if not isinstance(held, dict) or not isinstance(held.get("pid"), int):
        return ELSEWHERE
    if held.get("host") != here["host"] or held.get("pid_ns") != here["pid_ns"]:
        return ELSEWHERE
    if held.get("boot_id") and here["boot_id"] and held["boot_id"] != here["boot_id"]:
        return STALE  # this host started again since: every process of that boot is gone
    if held["pid"] == here["pid"] and held.get("process_start") == here["process_start"]:
        return MINE
    now = process_started(held["pid"])
    if now is None:
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return STALE
        except PermissionError:
            pass  # alive, another user's
        return LIVE
    start, state = now
    if state in "ZX" or (held.get("process_start") is not None and start != held["process_start"]):
        return STALE  # a zombie, or another process under the same pid
    return LIVE


def read(out) -> dict | None:
    """The lock OUT holds ({} when it cannot be read), None when it holds none."""
    path = Path(out) / LOCK
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {} if path.exists() else None


def who(held: dict) -> str:
    """'dstk train (pid 12 on host n1, started 2025-01-02 10:00:00, 3 min ago)'."""
    if not held:
        return "a run whose lock cannot be read"
    since = held.get("since")
    when = (f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}, "
            f"{_ago(time.time() - since)} ago" if isinstance(since, (int, float)) else "")
    return f"{held.get('what') or 'a run'} (pid {held.get('pid')} on host {held.get('host')}{when})"


def _ago(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def refusal(out, held: dict, verdict: str, flag: str = "--out") -> ConfigError:
    """The one message for a folder in use: who holds it, and how to clear a lock whose run is over."""
    path = Path(out) / LOCK
    where = ("its process is running on this host" if verdict == LIVE else
             "from another host or container, so dstk cannot tell from here whether it still runs")
    return ConfigError(f"{flag} {out} is in use by {who(held)}: {where}; two runs in one folder would mix their "
                       f"checkpoints, metrics and export. Wait for it to end, or choose another {flag}. If that run "
                       f"is over (its node went down, it was killed with kill -9), check, then remove the lock: "
                       f"rm {path}")


def holder(out) -> dict | None:
    """What OUT's lock says of the process that holds it, when another one does (a stale lock: None)."""
    held = read(out)
    return held if held is not None and judge(held) in (LIVE, ELSEWHERE) else None


def check_free(out, flag: str = "--out") -> None:
    """Refuse a folder another process holds (a stale lock passes: it is taken over)."""
    held = holder(out)
    if held is not None:
        raise refusal(out, held, judge(held), flag)


def acquire(out, what: str, flag: str = "--out") -> tuple[dict, str | None]:
    """Take OUT's lock (OUT made if missing): (what was written into it, a note when a stale lock was taken
    over). Refuses a lock another process holds."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path, mine, note = out / LOCK, me(what), None
    for _ in range(5):
        if _create(path, json.dumps(mine)):
            return mine, note
        held = read(out)
        if held == {}:
            time.sleep(0.2)  # being written (O_EXCL, no hard links here), or damaged: look once more
            held = read(out)
        if held is None:
            continue  # released meanwhile
        verdict = judge(held)
        if verdict in (LIVE, ELSEWHERE):
            raise refusal(out, held, verdict, flag)
        if _remove(path, held) and verdict == STALE:
            note = f"{flag} {out} was locked by {who(held)}, whose process is gone; taking the lock over"
    raise ConfigError(f"{flag} {out}: could not take its lock {path} (it changed hands 5 times); is another run "
                      "starting there?")


def release(out, mine: dict | None) -> None:
    """Remove OUT's lock when it is still the one `mine` describes (never another holder's)."""
    if mine is not None and read(out) == mine:
        (Path(out) / LOCK).unlink(missing_ok=True)


def _create(path: Path, text: str) -> bool:
    """Make `path` holding `text`, atomically, unless it exists."""
    tmp = path.with_name(f"{LOCK}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except OSError:
        if tmp.stat().st_nlink == 2:
            return True  # NFS: the link was made, its reply lost
        if path.exists() or path.is_symlink():
            return False
        return _create_exclusive(path, text)  # a file system without hard links
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def _remove(path: Path, held: dict) -> bool:
    """Remove a stale lock, unless another process replaced it since it was read (then it stays, and False)."""
    aside = path.with_name(f"{LOCK}.stale.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        moved = json.loads(aside.read_text())
    except (OSError, ValueError):
        moved = {}
    if moved != held and moved:  # a fresh lock taken meanwhile: put it back (never over a newer one)
        try:
            os.link(aside, path)
        except OSError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


GRACE_S = 5.0  # how long a graceful stop may take to unwind before the signal's default action ends the process


class RunLock:
    """OUT's lock for the span of a `with`: taken by `take` (a run: `take_on_rank0`), released on leaving, however.
    SIGTERM and SIGHUP release it, then end the process as they would have; at once, even while the main thread
    waits in C (a collective, a save), where Python would run a handler only after the call returns: a thread
    woken by the signal (signal.set_wakeup_fd) releases the lock and delivers the signal's default action. Where
    the process has a graceful handler of its own (toolkit.train's: the signal raised as Ctrl-C so clean-ups run),
    that handler runs, and the default action comes only if it has not ended the process within GRACE_S."""

    SIGNALS = ("SIGTERM", "SIGHUP")

    def __init__(self, out, what: str, flag: str = "--out"):
        self.out, self.what, self.flag = Path(out), what, flag
        self.held, self.note, self.handlers, self.wakeup = None, None, {}, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def take(self) -> None:
        self.held, self.note = acquire(self.out, self.what, self.flag)
        self._on_signals()

    def take_on_rank0(self, then=None) -> None:
        """Rank 0 takes the lock, then calls `then()` holding it (what OUT holds, judged once for every rank); every
        rank raises a refusal of either, as one line (toolkit.distributed.agreement: a collective of the world)."""
        import torch.distributed as dist

        from toolkit.distributed.agreement import agree

        with agree(f"taking {self.flag} {self.out}'s lock", name_ranks=False):  # rank 0 works for all
            if dist.get_rank() == 0:
                self.take()
                if then is not None:
                    then()

    def release(self) -> None:
        for number, previous in self.handlers.items():
            signal.signal(number, previous)
        self.handlers = {}
        if self.wakeup is not None:
            previous_fd, write_end = self.wakeup
            signal.set_wakeup_fd(previous_fd)
            os.close(write_end)  # the watching thread reads the end of its pipe and returns
            self.wakeup = None
        release(self.out, self.held)
        self.held = None

    def _on_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set there; the `with` still releases
        for name in self.SIGNALS:
            number = getattr(signal, name, None)
            current = signal.getsignal(number) if number is not None else None
            if current is signal.SIG_DFL or getattr(current, "graceful", False):
                self.handlers[number] = signal.signal(number, self._signalled)
        if self.handlers:
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)
            self.wakeup = (signal.set_wakeup_fd(write_end, warn_on_full_buffer=False), write_end)
            threading.Thread(target=self._watch, args=(read_end,), name="dstk-lock", daemon=True).start()

    def _watch(self, read_end: int) -> None:
        try:
            while data := os.read(read_end, 64):
                for number in data:
                    if number in self.handlers:
                        release(self.out, self.held)  # at once, whatever the main thread is doing
                        if self._graceful(number):  # the main thread's handler unwinds it; unless it waits in C
                            threading.Timer(GRACE_S, self._end_by, (number,)).start()
                        else:
                            self._end_by(number)
        finally:
            os.close(read_end)

    def _signalled(self, number, frame) -> None:
        if self._graceful(number):  # the process's own handler: its clean-ups run, then it ends by the signal
            release(self.out, self.held)
            self.handlers[number](number, frame)
        self._end_by(number)

    def _graceful(self, number: int) -> bool:
        return getattr(self.handlers.get(number), "graceful", False)

    def _end_by(self, number: int) -> None:
        """Release the lock file, then end the process by signal `number`'s default action."""
        release(self.out, self.held)
        end_by_default(number)


def end_by_default(number: int) -> None:
    """End the process by signal `number`'s default action, from any thread (libc's signal(): Python's may only be
    called in the main thread)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(number, None)  # SIG_DFL (a null handler)
    os.kill(os.getpid(), number)
