"""Run every benchmark in bench/, each as its own process, then assemble BENCHMARKS.md.

    .venv/bin/python bench/run_all.py --quick                 # `make bench`: a few minutes on 2 CPU cores
    .venv/bin/python bench/run_all.py --full                  # more repetitions, larger models
    .venv/bin/python bench/run_all.py --quick --only plan cli_startup
    .venv/bin/python bench/run_all.py --list

A script that does not exist (yet) is skipped with a message; one that fails is reported and the others
still run; the exit status is 1 if any failed. The GPU benchmarks print "skipped" and exit 0 without
CUDA. Durations and exit codes go to bench/results/run_all.json (not into BENCHMARKS.md).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

# name -> (script, flags in quick mode, flags in full mode), read from each script's argparse. Names match
# the BENCHMARKS.md fragments. A script's own default is its quick mode unless flags say otherwise.
SCRIPTS = {
    "cli_startup": ("cli_startup.py", ["--reps", "5"], ["--reps", "15"]),
    "partition": ("partition_balance.py", [], ["--full"]),
    "wrapper_overhead": ("wrapper_overhead.py", [], ["--full"]),
    "train": ("train_scaling.py", ["--steps", "10", "--warmup", "2"], ["--steps", "60", "--warmup", "5"]),
    "dualpipev": ("dualpipev.py", ["--reps", "3", "--steps", "6"], ["--reps", "7", "--steps", "12"]),
    "expert_parallel": ("expert_parallel.py", ["--reps", "3", "--steps", "6"],  # ~2 min on 2 cores
                        ["--reps", "7", "--steps", "12"]),
    "plan": ("plan_accuracy.py", [], []),
    "lora": ("lora_vs_full.py", ["--repeats", "1", "--steps", "4", "--warmup", "1"],  # ~2 min on 2 cores
             ["--repeats", "5", "--steps", "20", "--warmup", "4"]),
    "data_pipeline": ("data_pipeline.py", ["--quick", "--repeats", "1"],  # 20 MB: ~4 min on 2 cores
                      ["--mb", "200", "--repeats", "1"]),  # the size: ~25 min, ~20 GB RAM
    "long_context": ("long_context.py", ["--sps", "1", "2", "--cap", "4096"],  # ~12 min on 2 cores
                     ["--reps", "1"]),  # sp 1, 2 and 4: ~30 min
    "tiled_loss": ("tiled_loss.py", ["--lengths", "8192", "--reps", "1"],  # ~3 min on 2 cores
                   ["--lengths", "8192", "16384", "--reps", "3"]),
    "plan_gpu": ("plan_gpu.py", [], []),  # CUDA only
    "gpu": ("gpu_finetune.py", ["--quick"], []),  # CUDA only
}


def run_one(name: str, mode: str, timeout: float | None) -> dict:
    """Run one script; its output streams through. Returns what run_all.json records for it."""
    script_name, quick, full = SCRIPTS[name]
    script = BENCH / script_name
    if not script.exists():
        print(f"== {name}: skipped, {script.relative_to(ROOT)} does not exist yet", flush=True)
        return {"script": script_name, "status": "missing"}
    cmd = [sys.executable, str(script.relative_to(ROOT))] + (quick if mode == "quick" else full)
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    try:
        code = subprocess.run(cmd, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    seconds = time.perf_counter() - start
    status = "ok" if code == 0 else f"failed ({code})"
    print(f"== {name}: {status} in {seconds:.0f} s", flush=True)
    return {"script": script_name, "command": cmd[1:], "status": status, "seconds": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="few repetitions, small models (the default)")
    mode.add_argument("--full", action="store_true", help="more repetitions and larger models (much longer)")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=list(SCRIPTS),
                        help=f"run only these: {', '.join(SCRIPTS)}")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds allowed per script (default: 1200 in quick mode, none in full)")
    parser.add_argument("--list", action="store_true", help="print the benchmark names and scripts, run nothing")
    args = parser.parse_args()
    if args.list:
        for name, (script, *_) in SCRIPTS.items():
            print(f"{name:18} bench/{script}{'' if (BENCH / script).exists() else '  (missing)'}")
        return 0
    mode_name = "full" if args.full else "quick"
    timeout = args.timeout or (None if args.full else 1200)
    start = time.perf_counter()
    runs = {name: run_one(name, mode_name, timeout) for name in (args.only or SCRIPTS)}
    subprocess.run([sys.executable, str(BENCH / "report.py")], cwd=ROOT, check=True)
    total = time.perf_counter() - start
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "run_all.json").write_text(json.dumps(
        {"mode": mode_name, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(total, 1), "runs": runs},
        indent=2) + "\n")
    print(f"\n{mode_name} run: {total:.0f} s")
    for name, r in runs.items():
        print(f"  {name:18} {r['status']:14} {r.get('seconds', 0):6.0f} s")
    return 1 if any(r["status"].startswith("failed") for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
