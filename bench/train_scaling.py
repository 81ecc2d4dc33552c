"""Tokens/s of `dstk train` for dp=1, dp=2 and pp=2 on this machine, one thread per process.

    python bench/train_scaling.py                # ~3-4 minutes on 2 cores
    python bench/train_scaling.py --steps 20 --model tiny-gpt2

Same model, data and global batch (16 rows x 128 tokens) in every layout; each layout goes
through launch.sh like a user's run. Throughput is the median of the per-step tokens/s that
rank 0 logs, after the first `--warmup` steps. Next to it: ideal scaling (processes x dp=1)
and, for pp=2, the 1F1B prediction: ideal x (1 - bubble), bubble = (p-1)/(m+p-1), m = gas.
Writes bench/results/train_scaling.json and bench/results/train.md.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.plan.schedule import bubble_fraction  # noqa: E402

# name -> (processes, pp, mbs, gas): gbs = mbs * gas * dp = 16 everywhere
LAYOUTS = {"dp=1": (1, 1, 4, 4), "dp=2": (2, 1, 4, 2), "pp=2": (2, 2, 4, 4)}


def run_layout(name: str, args, tmp: Path) -> dict:
    procs, pp, mbs, gas = LAYOUTS[name]
    cfg = tmp / f"{name}.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "pipeline": {"stages": pp}, "steps_per_print": 10**6}))
    out = tmp / name.replace("=", "")
    cmd = ["bash", str(REPO / "launch.sh"), "--num-gpus", str(procs), "--config", str(cfg), "--",
           "--model", args.model, "--data", str(REPO / "toolkit/corpus/corpus.txt"), "--seq-len", "128",
           "--steps", str(args.steps), "--no-export", "--no-progress", "--eval-fraction", "0.01", "--out", str(out)]
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{name} failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "step" in r][args.warmup:]
    return {"processes": procs, "pp": pp, "dp": procs // pp, "mbs": mbs, "gas": gas,
            "tokens_per_s": statistics.median(rates), "steps_timed": len(rates)}


def add_predictions(results: dict) -> None:
    base = results["dp=1"]["tokens_per_s"]
    for r in results.values():
        r["ideal_tokens_per_s"] = base * r["processes"]
        r["bubble_predicted"] = bubble_fraction(r["pp"], r["gas"]) if r["pp"] > 1 else 0.0
        r["predicted_tokens_per_s"] = r["ideal_tokens_per_s"] * (1 - r["bubble_predicted"])
        r["efficiency"] = r["tokens_per_s"] / r["ideal_tokens_per_s"]


def markdown(results: dict, meta: dict) -> str:
    lines = [f"## dstk train: tokens/s by layout ({meta['model']}, seq 128, gbs 16, {meta['cpus']} CPUs, "
             "one thread per process)", "",
             "| layout | procs | tokens/s | ideal | 1F1B bubble (p-1)/(m+p-1) | predicted | measured / ideal |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['processes']} | {r['tokens_per_s']:.0f} | {r['ideal_tokens_per_s']:.0f} | "
                     f"{r['bubble_predicted']:.2f} | {r['predicted_tokens_per_s']:.0f} | {r['efficiency']:.2f} |")
    lines += ["", f"Command: `{meta['command']}`. Median of per-step tokens/s after {meta['warmup']} warm-up steps.",
              f"1-minute load average before/after: {meta['load_average_1min'][0]:.1f} / "
              f"{meta['load_average_1min'][1]:.1f} on {meta['cpus']} CPUs (a load above the CPU count means other work "
              "shared the machine and the 2-process layouts could not scale).",
              "pp=2 falls short of its 1F1B prediction; presumably the p2p sends and the tied-embedding all-reduce (not measured apart)."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="small-gpt2")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_layout(name, args, Path(tmp)) for name in LAYOUTS}
    add_predictions(results)
    meta = {"model": args.model, "cpus": os.cpu_count(), "platform": platform.platform(), "warmup": args.warmup,
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "command": "python bench/train_scaling.py " + " ".join(sys.argv[1:])}
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_scaling.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "train.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
