"""The rank's side of surviving failures (toolkit.distributed.resilience), each part for real in seconds: the
--step-timeout watchdog in a process of its own (it ends it), a peer's ended process found through /proc, the
errors of a collective whose peer is gone told from others, --save-on-signal's signals agreed on in a real gloo
group, and master ports drawn outside the ephemeral range. The whole story, ranks killed and restarted through
launch.sh: tests/launchers/test_restarts.py."""

import os
import signal
import socket
import subprocess
import sys
import zlib
from pathlib import Path

from toolkit.distributed import resilience
from toolkit.distributed.process_group import DEFAULT_PORT, ephemeral_ports, free_port, listenable

REPO = Path(__file__).resolve().parents[2]


def watched(body: str, tmp_path) -> subprocess.CompletedProcess:
    """`body` run under a Watchdog of 1 s for rank 3 whose before_exit writes tmp_path/released."""
    code = ("import time\nfrom pathlib import Path\nfrom toolkit.distributed.resilience import Watchdog\n"
            f"dog = Watchdog(1, 3, lambda: Path({str(tmp_path / 'released')!r}).write_text('yes'))\n" + body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_section_past_the_timeout_ends_the_rank_with_one_line_naming_it(tmp_path):
    done = watched("def slow_part():\n    time.sleep(30)\nwith dog.section('step 7'):\n    slow_part()\n", tmp_path)
    assert done.returncode == resilience.STEP_TIMEOUT, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 3: step 7 has run "), done.stderr
    assert "past --step-timeout 1: at <string>:" in lines[0] and lines[0].endswith("slow_part; stopping"), lines
    assert (tmp_path / "released").read_text() == "yes"


def test_sections_within_the_timeout_and_time_between_them_are_not_cut(tmp_path):
    body = ("for step in range(4):\n    with dog.section(f'step {step}'):\n        time.sleep(0.5)\n"
            "time.sleep(2.5)  # outside any section: not watched\nprint('done')\n")
    done = watched(body, tmp_path)
    assert done.returncode == 0 and done.stdout == "done\n" and done.stderr == "", done.stderr
    assert not (tmp_path / "released").exists()


def test_the_errors_of_a_collective_whose_peer_is_gone_are_told_from_others():
    import torch.distributed as dist

    from toolkit.errors import RankFailed

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27061: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert resilience.peer_lost(gloo) and resilience.peer_lost(dist.DistNetworkError("store gone"))
    try:
        try:
            raise gloo
        except RuntimeError as exc:
            raise RankFailed("rank 1 failed") from exc
    except RankFailed as wrapped:
        assert resilience.peer_lost(wrapped)
    assert not resilience.peer_lost(RuntimeError("CUDA out of memory")) and not resilience.peer_lost(ValueError("x"))


def test_a_peer_whose_process_ended_is_named(capsys, monkeypatch):
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    here = zlib.crc32(socket.gethostname().encode())
    monkeypatch.setattr(resilience, "_PEERS", [(here, os.getpid()), (here, peer.pid), (here + 1, peer.pid)])
    monkeypatch.setattr(resilience, "LAUNCHER_GRACE_S", 0.0)
    try:
        assert resilience.gone_ranks(wait_s=0) == []
        peer.kill()  # not reaped yet: a zombie, as a rank is until its launcher polls it
        assert resilience.gone_ranks() == [1]
        with resilience.PROGRESS.of("step 6"):
            resilience.say_peer_lost(RuntimeError("Connection reset by peer"), 0)
    finally:
        peer.wait()
    assert capsys.readouterr().err == "rank 0: rank 1 is gone during step 6: stopping\n"


def test_save_on_signal_notes_signals_and_every_rank_agrees_on_them(ds_world1):
    import torch

    seen = []
    before = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        stop = resilience.SignalStop()
        assert stop.agreed(torch.device("cpu")) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed(torch.device("cpu")) == "SIGUSR1" and seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: the handler the process had
        assert seen == [signal.SIGTERM]
        stop.restore()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_master_ports_are_drawn_free_and_outside_the_ephemeral_range():
    low, high = ephemeral_ports()
    ports = [free_port() for _ in range(40)]
    assert all(not low <= p <= high and 1024 <= p <= 65535 and p != DEFAULT_PORT for p in ports), ports
    assert len(set(ports)) > 30  # drawn at random: two launches at one moment do not share one
    with socket.create_server(("", ports[0])):
        assert not listenable(ports[0])
    assert listenable(ports[0])
