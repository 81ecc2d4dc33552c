"""The tiled loss on CPU: activation memory and tokens/s of `dstk train` with the whole logits (--tiled-loss off,
what dstk did before it) against its default (--tiled-loss auto, on at these lengths), and the planner's
activations for both.

    python bench/tiled_loss.py                        # ~10 minutes on 2 cores
    python bench/tiled_loss.py --lengths 8192 --reps 3

Model: a small Llama (bench/long_context.py's: hidden 256, 2 blocks) with a 32000-token vocabulary, random weights,
the byte tokenizer, fp32, ZeRO-0, mbs 1, gas 1, one rank, activation checkpointing on, one document per row: every
run is `launch.sh` like a user's. Activations: the run's peak resident set (peak_mem_mib) less that of a 512-token run
(the process, model and optimizer states); the planner's figure is the same difference of its own activations
(the run's less the 512-token run's) plus, where the run's loss is tiled, the head's weight gradient (bench/
long_context.py: alive at the tiled run's peak, not yet at the whole logits' one). Runs alternate off, auto, off, auto, ...; medians of --reps.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import long_context  # noqa: E402
from bench.common import build_llama, write_markdown, write_result  # noqa: E402
from bench.long_context import ARCH, VOCAB  # noqa: E402

BASE_LEN = 512
MiB = 2**20


def build_model(folder: Path) -> Path:
    return build_llama(folder, ARCH, VOCAB)


def run(model: Path, length: int, mode: str, steps: int, tmp: Path) -> dict | None:
    """One launch.sh run of one rank (bench/long_context.py's, with activation checkpointing and every core)."""
    return long_context.run(model, 1, length, steps, tmp, flags=("--tiled-loss", mode), threads=os.cpu_count(),
                            config={"activation_checkpointing": {"partition_activations": False}})


def predicted_activations(model: Path, length: int, mode: str) -> int:
    """The planner's activation bytes for this run's layout (pp 1, dp 1, ZeRO-0, mbs 1, fp32, checkpointing)."""
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    result = make_plan(PlanRequest(model=str(model), gpus_per_node=1, gbs=1, seq_len=length, precision="fp32",
                                   gpu_mem=2**50, tflops=1.0, checkpointing=True, offload=False, tiled_loss=mode))
    return next(e.activations for e in result.fitting
                if (e.layout.pp, e.layout.sp, e.layout.zero, e.layout.tp, e.layout.checkpointing) == (1, 1, long_context.ZERO, 1, True))


def predicted_share(model: Path, length: int, mode: str) -> float:
    """MiB the planner counts above the base run, as the benchmark measures: its activations at `length` less its own
    for the base run (BASE_LEN tokens, whole logits)."""
    from models.tiled.loss import choose

    head_grad = 4 * ARCH["hidden_size"] * VOCAB if choose(mode, length, VOCAB)[0] else 0
    return (predicted_activations(model, length, mode) + head_grad - predicted_activations(model, BASE_LEN, "off")) / MiB


def measure(model: Path, lengths: list, reps: int, steps: int, tmp: Path) -> list:
    base = run(model, BASE_LEN, "off", steps, tmp)
    if base is None:
        return [{"length": length, "status": "the base run failed"} for length in lengths]
    rows = []
    for length in lengths:
        samples = {"off": [], "auto": []}
        for _ in range(reps):
            for mode in samples:
                samples[mode].append(run(model, length, mode, steps, tmp))
        row = {"length": length, "status": "ok", "base_peak_mib": base["peak_mib"]}
        for mode, got in samples.items():
            ok = [g for g in got if g is not None]
            row[mode] = {"failed": len(got) - len(ok),
                         "activation_mib": statistics.median(g["peak_mib"] for g in ok) - base["peak_mib"] if ok else None,
                         "tokens_per_s": statistics.median(g["tokens_per_s"] for g in ok) if ok else None,
                         "predicted_mib": predicted_share(model, length, mode)}
        if row["off"]["failed"] or row["auto"]["failed"]:
            row["status"] = "failed runs"
        rows.append(row)
        print(f"  {length} tokens: {row}", flush=True)
    return rows


def markdown(meta: dict, rows: list) -> list:
    lines = [f"Model: small Llama (hidden {ARCH['hidden_size']}, {ARCH['num_hidden_layers']} blocks) with a {VOCAB}-token "
             f"vocabulary, fp32, ZeRO-0, mbs 1, one rank, activation checkpointing on, one document per row. "
             f"Activations: peak RSS above a {BASE_LEN}-token run (the planner's: its activations less its own "
             f"for that run). Median of {meta['reps']} runs each, alternated. "
             f"{meta['cpus']} CPUs; load average {meta['load'][0]:.1f} before, {meta['load'][1]:.1f} after.", "",
             "| tokens | activations, whole logits | activations, tiled (default) | tiled / whole | planner: whole, tiled "
             "| tokens/s whole | tokens/s tiled | tiled / whole |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['length']} | failed: {r['status']} | | | | | | |")
            continue
        off, auto = r["off"], r["auto"]
        lines.append(f"| {r['length']} | {off['activation_mib']:.0f} MiB | {auto['activation_mib']:.0f} MiB | "
                     f"{auto['activation_mib'] / off['activation_mib']:.2f} | {off['predicted_mib']:.0f} MiB, "
                     f"{auto['predicted_mib']:.0f} MiB | {off['tokens_per_s']:.0f} | {auto['tokens_per_s']:.0f} | "
                     f"{auto['tokens_per_s'] / off['tokens_per_s']:.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="dstk-tiled-") as name:
        tmp = Path(name)
        runs = tmp / "runs"
        runs.mkdir()
        rows = measure(build_model(tmp / "model"), args.lengths, args.reps, args.steps, runs)
    load.append(os.getloadavg()[0])
    meta = {"reps": args.reps, "load": load, "cpus": os.cpu_count()}
    write_result("tiled_loss", {"meta": meta, "rows": rows})
    lines = markdown(meta, rows)
    write_markdown("tiled_loss", "Long sequences: the tiled loss on CPU", lines)
    print("\n".join(lines))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
