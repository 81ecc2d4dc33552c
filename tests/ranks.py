"""Real ranks forked from a warm process: how the tests start dstk on several CPU processes.

A launcher (deepspeed, torchrun) starts every rank as a fresh interpreter, which spends 15-18 s on
2 cores importing torch, deepspeed and transformers before it does anything. Here one server process
per test session limits threads, imports them once, and then forks the ranks of each launch from
itself (a fraction of a second). It makes no process group, thread pool or accelerator state before a
fork. Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR and
MASTER_PORT as the deepspeed launcher sets them on one node, and runs the real program, `python -m
toolkit.train ARGS` (what launch.sh starts) or a script, with real gloo process groups, real engines
and real files. The launchers themselves are tested through their own commands
(tests/launchers/test_launchers.py).

    from tests.ranks import run_ranks
    rc, log = run_ranks(["-m", "toolkit.train", "--config", cfg, ...], nprocs=2, timeout=300)

A launch ends as under the deepspeed launcher: every rank exits 0 -> 0; a rank exits non-zero -> the
other ranks get a grace second to print, are killed, and that exit code is returned; a signal -> minus
its number, as subprocess reports it. Past `timeout` every rank is killed and run_ranks raises
RankTimeout with the output so far. Each launch is a process group of its own, killed as a whole when
it ends, and every process here dies with its parent (PR_SET_PDEATHSIG): nothing outlives its test or
the session. stdout and stderr of all ranks arrive merged, line by line, as a launcher forwards them.
Its own tests: tests/distributed/test_ranks.py.
"""

import atexit
import ctypes
import gc
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What every rank's environment holds, as the tests' launches always set it (and before the server's
# imports: OpenMP reads its thread count when torch loads). TORCH_WARM_POOL=0: torch 2.7 with triton installed
# (a CUDA build, as at setup.cfg's torch floor) starts inductor's compile-worker pool, a process and a reader
# thread, when torch._inductor.async_compile is imported (DeepSpeed's Muon import does; 2.13 waits until it
# compiles), and a rank forked from the warm server would hang.
RANK_ENV = dict(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                TORCH_WARM_POOL="0")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
             "MASTER_ADDR", "MASTER_PORT")
GRACE_S = 1.0  # after a rank fails, what the others get to finish printing (the deepspeed launcher polls each 1 s)


class RankTimeout(AssertionError):
    """A launch ran past its timeout; every one of its processes has been killed."""


# ---------------------------------------------------------------------------------------------- client

class RankServer:
    """The warm process, started on first use and stopped at exit (or with this process, whatever kills it)."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="dstk-ranks-")
        self.address = os.path.join(self.folder, "socket")
        env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        env.update(RANK_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
                   JE_ARROW_MALLOC_CONF="background_thread:false")  # pyarrow's jemalloc: no purging thread
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.ranks", self.address], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = self.proc.stdout.readline()  # the server's only line on its own stdout
        if ready.strip() != "ready":
            rest = self.proc.communicate(timeout=60)[0] if self.proc.poll() is not None else ""
            self.close()
            raise RuntimeError(f"the rank server did not start:\n{ready}{rest}")

    def run(self, argv: list, nprocs: int, env: dict, cwd: Path, timeout: float) -> tuple:
        request = dict(argv=[str(a) for a in argv], nprocs=nprocs, env=env, cwd=str(cwd), timeout=timeout)
        with Client(self.address, family="AF_UNIX") as conn:
            conn.send(request)
            try:
                answer = conn.recv()
            except EOFError:
                log = Path(self.folder, "server.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the rank server gave no answer for {argv} (rc {self.proc.poll()}); "
                                   f"its log:\n{log}") from None
        if answer["timed_out"]:
            raise RankTimeout(f"{nprocs} rank(s) of {' '.join(request['argv'])} ran past {timeout} s and were "
                              f"killed; their output:\n{answer['output'][-4000:]}")
        return answer["rc"], answer["output"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # the server kills every launch still running
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_server = None


def server() -> RankServer:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = RankServer()
        atexit.register(_server.close)
    return _server


def run_ranks(argv: list, nprocs: int, env: dict | None = None, cwd: Path = REPO, timeout: float = 300) -> tuple:
    """Run `python ARGV` (ARGV: ['-m', MODULE, ...] or [SCRIPT, ...]) as `nprocs` ranks of one world on
    this machine; (exit code, merged output). `env`: extra variables over this process's environment."""
    full = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    full.update(RANK_ENV, PYTHONPATH=str(REPO), **(env or {}))
    return server().run(argv, nprocs, full, cwd, timeout)


def run_train(args: list, nprocs: int, env: dict | None = None, timeout: float = 300) -> tuple:
    """What `launch.sh --num-gpus N --config CFG -- ...` does, with `args` = ['--config', CFG, ...]: the
    refusals checked once (`toolkit.train --check --world-size N`, output dropped as launch.sh drops its
    stdout; a refusal ends the launch with its code), then `python -m toolkit.train ARGS` on N ranks."""
    rc, log = run_ranks(["-m", "toolkit.train", "--check", "--world-size", nprocs, *args], 1, env, timeout=timeout)
    if rc:
        return rc, log
    return run_ranks(["-m", "toolkit.train", *args], nprocs, env, timeout=timeout)


# ---------------------------------------------------------------------------------------------- server

def _die_with_parent():
    """SIGKILL this process when its parent exits (Linux prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _warm_up():
    """Import what every rank imports, before any fork. Nothing here may start a thread: a forked child
    keeps only the forking thread (OpenMP and tokenizer pools made before a fork hang in the child)."""
    import threading

    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.comm  # noqa: F401
    import deepspeed.runtime.pipe  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models import bert, gpt2, llama  # noqa: F401

    import toolkit.cli  # noqa: F401
    import toolkit.train.loop  # noqa: F401
    import toolkit.train.runner  # noqa: F401
    from toolkit.train import hf  # noqa: F401

    # What every engine or rank 0 imports later, lazily, at a cost paid again in each rank of each launch:
    # deepspeed.initialize checks the optimizer against ZeRO's list, which imports the Muon optimizer and
    # with it torch._dynamo and torch._inductor (~1 s); rank 0 draws loss.png with matplotlib (~0.2 s,
    # the Agg backend as toolkit.train.report selects it); the config checks, the planner's counts, the export.
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    import models.api  # noqa: F401
    import toolkit.config.loader  # noqa: F401
    import toolkit.config.validate  # noqa: F401
    import toolkit.export.directory  # noqa: F401
    import toolkit.plan.arch  # noqa: F401
    import toolkit.plan.cost.mfu  # noqa: F401
    import models.lora.adapters  # noqa: F401

    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError(f"the warm-up started threads ({len(os.listdir('/proc/self/task'))} native): "
                           "forked ranks would hang")
    # Everything imported so far lives as long as the server: out of the collector's sight, a full collection
    # in a rank (DeepSpeed's BF16_Optimizer forces six at start-up, the trainer one at its end) walks only
    # the rank's own objects, ~0.3 s less each; and the ranks do not dirty the shared pages walking these.
    gc.collect()
    gc.freeze()


def serve(address: str):
    _die_with_parent()
    _warm_up()
    listener = Listener(address, family="AF_UNIX")
    jobs = set()

    def stop(*_):
        for pid in jobs:
            _kill_group(pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    # From here on the server's own output (and a job's, should one fail outside its ranks) goes to a log
    # beside the address: nobody reads the pipe to the client any more, and a full pipe would block.
    log = os.open(os.path.join(os.path.dirname(address), "server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    while True:
        conn = listener.accept()
        for pid in list(jobs):  # reap finished launches
            if os.waitpid(pid, os.WNOHANG)[0]:
                jobs.discard(pid)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # (the listener stays open here: closing it would remove the server's address)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _job(conn)  # never returns
        conn.close()
        jobs.add(pid)


def _kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _job(conn):
    """One launch: a process group of its own (its id is this process's pid) holding its ranks."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        conn.send(_launch(conn.recv()))
        code = 0
    finally:
        conn.close()
        # whatever the ranks started (data loader workers, tokenizer processes) goes with the launch
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        os._exit(code)


def _launch(request: dict) -> dict:
    from toolkit.distributed.process_group import free_port

    port, ranks = free_port(), {}
    for rank in range(request["nprocs"]):
        read_end, write_end = os.pipe()  # one per rank: its lines arrive whole, as a launcher forwards them
        pid = os.fork()
        if pid == 0:
            for fd in [read_end, *(r for _, r in ranks.values())]:
                os.close(fd)
            _rank(request, rank, port, write_end)  # never returns
        os.close(write_end)
        ranks[pid] = (rank, read_end)
    return _watch(ranks, request["timeout"])


class _Lines:
    """The ranks' output: whole lines in the order they were completed."""

    def __init__(self, ends: list):
        self.open, self.partial, self.lines = set(ends), {fd: b"" for fd in ends}, []

    def read(self, wait: float):
        for fd in select.select(list(self.open), [], [], wait)[0] if self.open else time.sleep(wait) or []:
            self.take(fd)

    def take(self, fd: int) -> bool:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            self.open.discard(fd)
            return False
        *whole, self.partial[fd] = (self.partial[fd] + chunk).split(b"\n")
        self.lines.extend(line + b"\n" for line in whole)
        return True

    def drain(self) -> str:
        """What is left, without waiting for a grandchild that still holds a pipe."""
        for fd in list(self.open):
            os.set_blocking(fd, False)
            while self.take(fd):
                pass
        self.lines.extend(rest for rest in self.partial.values() if rest)
        return b"".join(self.lines).decode(errors="replace")


def _watch(ranks: dict, timeout: float) -> dict:
    """Collect the ranks' output and exit codes until all exit, one fails (+ grace) or time runs out."""
    start, codes, failed_at, first_rc = time.monotonic(), {}, None, 0
    out = _Lines([fd for _, fd in ranks.values()])
    timed_out = False
    while len(codes) < len(ranks):
        now = time.monotonic()
        if now - start > timeout:
            timed_out = True
            break
        if failed_at is not None and now - failed_at > GRACE_S:
            break
        out.read(0.05)
        for pid in [p for p in ranks if p not in codes]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] and failed_at is None:
                    failed_at, first_rc = time.monotonic(), codes[pid]
    for pid in ranks:  # those still running: hung, or left behind by a failed rank
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return dict(rc=first_rc, timed_out=timed_out, output=out.drain())


def _rank(request: dict, rank: int, port: int, write_end: int):
    """In the forked child: become rank `rank`, run the program, exit with its code."""
    import random
    import runpy
    import traceback

    code = 1
    try:
        _die_with_parent()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        nprocs = request["nprocs"]
        os.environ.clear()
        os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                          LOCAL_SIZE=str(nprocs), CROSS_RANK="0", CROSS_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        os.chdir(request["cwd"])
        random.seed()  # a fresh interpreter's state, not the server's
        import importlib

        import huggingface_hub.constants

        importlib.reload(huggingface_hub.constants)  # read at import: this launch's HF_HUB_CACHE, HF_HUB_OFFLINE
        import numpy
        import torch

        numpy.random.seed()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
