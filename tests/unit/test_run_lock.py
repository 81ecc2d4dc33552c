"""One run per folder (toolkit.checkpoint.lock): OUT/.dstk.lock names who writes the folder; another process's live
lock is refused naming it (host, pid, start) and how to clear it, a lock from another host is never judged stale,
a stale one (its process gone, its pid reused, its host restarted) is taken over saying so, and a process releases
only its own. `dstk train --check`, `dstk export` and `dstk reshard` respect it. SIGTERM releases it even while the
main thread waits in C. Two real runs into one folder, and a run's release at its end, on error and on SIGTERM:
tests/distributed/test_run_lock.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_train_refusals import refused, train_cli
from toolkit.checkpoint import lock
from toolkit.checkpoint.manifest import write_latest
from toolkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sleeper():
    """A live process of this host that is not this one (what another run's rank 0 is)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def held_by(out: Path, pid: int, **over) -> dict:
    """Write OUT's lock as process `pid` of this host would have taken it."""
    out.mkdir(parents=True, exist_ok=True)
    start = lock.process_started(pid)
    held = {**lock.me("dstk train"), "pid": pid, "process_start": start[0] if start else None, **over}
    (out / lock.LOCK).write_text(json.dumps(held))
    return held


def test_a_live_lock_is_refused_naming_its_run_and_how_to_clear_it(tmp_path, sleeper):
    out = tmp_path / "run"
    held_by(out, sleeper.pid)
    with pytest.raises(ConfigError) as refusal:
        lock.acquire(out, "dstk train")
    said = str(refusal.value)
    assert f"--out {out} is in use by dstk train (pid {sleeper.pid} on host {socket.gethostname()}, started " in said
    assert "its process is running on this host" in said and f"rm {out / lock.LOCK}" in said
    sleeper.kill()
    sleeper.wait()  # gone: the lock is stale, taken over with a note naming the run that held it
    mine, note = lock.acquire(out, "dstk train")
    assert note.startswith(f"--out {out} was locked by dstk train (pid {sleeper.pid}") and "process is gone" in note
    assert json.loads((out / lock.LOCK).read_text()) == mine and mine["pid"] == os.getpid()
    lock.release(out, mine)
    assert sorted(os.listdir(out)) == []  # no lock, no file it was made from


def test_a_lock_from_another_host_is_never_judged_stale(tmp_path):
    out = tmp_path / "run"
    held_by(out, 999_999_999, host="node-b")  # no such pid here: on its own host it may well run
    with pytest.raises(ConfigError, match=r"pid 999999999 on host node-b.*from another host or container, so dstk "
                                          r"cannot tell.*rm .*\.dstk\.lock"):
        lock.acquire(out, "dstk train")
    with pytest.raises(ConfigError, match="from another host"):
        lock.check_free(out)


@pytest.mark.parametrize("over", [{"process_start": 1}, {"boot_id": "an-earlier-boot"}],
                         ids=["pid reused by another process", "host restarted since"])
def test_a_lock_whose_process_cannot_be_the_holder_is_stale(tmp_path, sleeper, over):
    out = tmp_path / "run"
    held_by(out, sleeper.pid, **over)
    mine, note = lock.acquire(out, "dstk reshard")
    assert "process is gone; taking the lock over" in note
    lock.release(out, mine)


def test_a_process_releases_only_its_own_lock(tmp_path, sleeper):
    out = tmp_path / "run"
    mine, _ = lock.acquire(out, "dstk train")
    other = held_by(out, sleeper.pid)  # removed by hand and taken by another run meanwhile
    lock.release(out, mine)
    assert json.loads((out / lock.LOCK).read_text()) == other


def test_check_refuses_an_out_in_use_and_passes_one_whose_lock_is_stale(tmp_path, sleeper):
    """`dstk train --check` (what launch.sh runs first): a live lock is refused naming its run; a stale lock is not
    a file of the run (an --out holding only that is empty) and passes."""
    out = tmp_path / "run"
    held_by(out, sleeper.pid)
    refused(train_cli(tmp_path, "--steps", "2", "--check"), 1, f"--out {out} is in use by dstk train (pid "
            f"{sleeper.pid}", f"rm {out / lock.LOCK}")
    refused(train_cli(tmp_path, "--steps", "2", "--resume", "--check"), 1, "is in use by dstk train")
    sleeper.kill()
    sleeper.wait()
    ok = train_cli(tmp_path, "--steps", "2", "--check")
    assert ok.returncode == 0 and "fit to train" in ok.stdout, ok.stderr


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A checkpoint folder as export and reshard find it (dstk/, a tag, latest); nothing is read past their checks."""
    ckpt = tmp_path / "source" / "checkpoints"
    (ckpt / "dstk").mkdir(parents=True)
    (ckpt / "global_step2").mkdir()
    write_latest(ckpt, "global_step2")
    return ckpt


@pytest.mark.parametrize("target, refused_there", [("run", True), ("run/hf", True), ("run/checkpoints/x", True),
                                                   ("run/hf_step2", False)])
def test_export_and_reshard_refuse_writing_what_a_running_run_writes(tmp_path, sleeper, checkpoint, target,
                                                                     refused_there):
    """A run writes its folder's checkpoints/, hf/, adapter/, metrics...: export or reshard there is refused while it
    runs (its own export at the end would replace it); a folder of one's own inside it is not the run's."""
    from toolkit.checkpoint.reshard import reshard_checkpoint
    from toolkit.export.directory import export

    held_by(tmp_path / "run", sleeper.pid)
    for write, flag in ((lambda: export(checkpoint, tmp_path / target), "OUT_DIR"),
                        (lambda: reshard_checkpoint(checkpoint, tmp_path / target), "OUT_DIR")):
        with pytest.raises(Exception) as raised:
            write()
        said = str(raised.value)
        assert (f"in use by dstk train (pid {sleeper.pid}" in said) == refused_there, said
        if refused_there:
            assert isinstance(raised.value, ConfigError) and f"rm {tmp_path / 'run' / lock.LOCK}" in said


def test_a_stale_lock_is_not_a_file_of_the_run_and_overwrite_keeps_the_live_one(tmp_path):
    from toolkit.checkpoint.run_folder import check_out, clear

    out = tmp_path / "run"
    mine, _ = lock.acquire(out, "dstk train")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "checkpoints").mkdir()
    clear(out)  # --overwrite, by the run holding the lock
    assert os.listdir(out) == [lock.LOCK]
    lock.release(out, mine)
    check_out(out, resume=False, overwrite=False)


HOLD = """
import ctypes, signal, sys
from toolkit.checkpoint.lock import RunLock
with RunLock(sys.argv[1], "test") as held:
    held.take()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    libc = ctypes.CDLL(None)
    waited, got = (ctypes.c_ubyte * 128)(), ctypes.c_int()
    libc.sigemptyset(waited)
    libc.sigaddset(waited, signal.SIGUSR1)
    print("taken", flush=True)
    libc.sigwait(waited, ctypes.byref(got))  # in C until SIGUSR1, as a rank waits in a collective: Python's own
print("never", flush=True)                   # handler would run only after it returns
"""


def test_sigterm_releases_the_lock_and_ends_the_process_while_it_waits_in_c(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "taken"
        assert (out / lock.LOCK).is_file()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM  # ended by the signal itself, as without the lock
    finally:
        proc.kill()
        proc.wait()
    assert not (out / lock.LOCK).exists() and "never" not in proc.stdout.read()


def test_sigterm_with_the_main_thread_in_python_releases_too(tmp_path):
    out = tmp_path / "run"
    code = ("import sys, time\nfrom toolkit.checkpoint.lock import RunLock\nwith RunLock(sys.argv[1], 'test') as h:\n"
            "    h.take()\n    print('taken', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "taken"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM and time.monotonic() - start < 5
    finally:
        proc.kill()
        proc.wait()
    assert not (out / lock.LOCK).exists()
