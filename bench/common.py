"""Shared benchmark plumbing: machine facts, alternating A/B repetitions, medians, JSON results.

Machines here are shared and noisy: compare side by side in one run (A, B, A, B, ...) and report
ratios of medians, never absolute thresholds.
"""

import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "cpu_model": cpu_model(),
            "versions": _versions()}


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo): the same command on another host of this pool can run 30% slower."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _versions() -> dict:
    out = {}
    for pkg in ("torch", "deepspeed", "transformers", "click", "jsonschema"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def time_command(cmd: list[str], env=None) -> float:
    """Wall seconds of one run of a command (output discarded; a failure raises)."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def launch(cmd: list, log: Path, env: dict, timeout: float, cwd: Path | None = None, watch=None) -> tuple:
    """Run `cmd` in `cwd` (the repository by default), launcher and ranks in one new process group, output in
    `log`; (exit code or None when killed at `timeout`, wall seconds). At the timeout SIGTERM goes to the
    group (the launcher forwards it to the ranks), SIGKILL 30 s later. A SIGTERM to this process while it waits
    (gpu.sh's backstop `timeout`) or Ctrl-C stops the group too (SIGKILL 5 s later), then exits: a group of its
    own outlives this process otherwise, holding its GPUs. `watch(pid)`, asked every half second, stops the group
    as the timeout does when it returns True (a run past a memory limit: tree_peak_mib)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd or Path(__file__).resolve().parents[1], env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        on_main = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main else None
        try:
            rc = _wait(proc, start + timeout, watch)
        except subprocess.TimeoutExpired:
            _stop(proc, 30)
            rc = None
        except BaseException:
            _stop(proc, 5)
            raise
        finally:
            if on_main:
                signal.signal(signal.SIGTERM, previous)
    return rc, time.perf_counter() - start


def _wait(proc: subprocess.Popen, deadline: float, watch) -> int:
    """proc's exit code; TimeoutExpired past `deadline` (perf_counter seconds) or once `watch(proc.pid)` is True."""
    if watch is None:
        return proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
    while True:
        try:
            return proc.wait(timeout=min(0.5, max(0.0, deadline - time.perf_counter())))
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline or watch(proc.pid):
                raise


def tree_peak_mib(pid: int) -> float:
    """The largest peak resident set (VmHWM, MiB) among process `pid` and its live descendants (Linux /proc; the
    ranks: DeepSpeed's runner starts a session of its own): on CPU what a rank's peak_mem_mib will say, while it
    runs."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # state, ppid
        except (OSError, IndexError, ValueError):  # the process ended in between
            continue
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | more, bool(more)
    best = 0.0
    for member in tree:
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        hwm = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), None)
        best = max(best, int(hwm) / 1024 if hwm else 0.0)
    return best


def build_llama(folder: Path, arch: dict, vocab: int | None = None) -> Path:
    """A small Llama of `arch` (LlamaConfig fields), random weights, untied head, and the byte tokenizer, saved as a
    HF directory; `vocab` outputs (None: the tokenizer's; ids past the tokenizer's are never seen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.train.hf import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=vocab or len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **arch)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL `grace_s` seconds later if it is still there."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # the group ended in between
        proc.wait()


def extract(rev: str, dest: Path, paths=("toolkit", "models", "setup.cfg", "launch.sh")) -> Path:
    """`paths` of commit `rev` under dest (git archive: the checkout is untouched)."""
    dest.mkdir()
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def alternate(cases: dict, reps: int) -> dict:
    """Run each case's callable once per round, round after round; name -> list of seconds."""
    samples = {name: [] for name in cases}
    for _ in range(reps):
        for name, run in cases.items():
            samples[name].append(run())
    return samples


def summarize(samples: dict, baseline: str | None = None) -> dict:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    out = {name: {"median_s": medians[name], "runs_s": values} for name, values in samples.items()}
    if baseline:
        for name in out:
            out[name]["ratio_to_" + baseline] = medians[name] / medians[baseline]
    return out


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {"benchmark": name, "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv),
               "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def write_markdown(name: str, title: str, lines: list[str]) -> Path:
    """A fragment of BENCHMARKS.md: results/NAME.md, assembled by bench/report.py."""
    RESULTS.mkdir(exist_ok=True)
    info = machine()
    header = [f"## {title}", "", f"Command: `{' '.join([Path(sys.executable).name] + sys.argv)}`  ",
              f"Machine: {info['processor']}" + (f" ({info['cpu_model']})" if info["cpu_model"] else "")
              + f", {info['cpus']} CPUs, Python {info['python']}, "
              + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v) + "  ",
              f"Measured: {time.strftime('%Y-%m-%d %H:%M')}", ""]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(header + lines) + "\n")
    return path
