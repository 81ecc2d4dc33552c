"""Planner accuracy on CPU: model-state bytes per rank that toolkit.plan.memory predicts vs what real DeepSpeed
engines hold, for ZeRO 0/1/2/3 at pp 1 (dp 2) and ZeRO 0/1 at pp 2 (dp 1).

    .venv/bin/python bench/plan_accuracy.py        # one 2-process deepspeed launch, about a minute

The measuring is tests/distributed/test_memory_accuracy.py's (imported, not copied): one launch of the
deepspeed launcher, 2 CPU processes on gloo, a stack of 8 Linear(512, 512) layers in fp32 with torch's
AdamW, each engine's distinct tensor storages summed at its peak moment. Bytes are deterministic, so
there are no repetitions. Writes bench/results/plan.json and plan.md.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import write_markdown, write_result  # noqa: E402

MiB = 2**20


def predicted(zero: int, pp: int):
    """toolkit.plan.memory's ModelStates for one rank of the test's model: its stage is LAYERS / pp layers."""
    from tests.distributed.test_memory_accuracy import BUCKET, HIDDEN, LAYERS
    from toolkit.plan.memory import model_state_bytes

    stage_params = (LAYERS // pp) * (HIDDEN * HIDDEN + HIDDEN)  # uniform split, weight + bias per layer
    return stage_params, model_state_bytes(stage_params, dp=2 // pp, zero=zero, precision="fp32", optimizer="adam",
                                           pipeline=pp > 1, reduce_bucket_size=BUCKET)


def table(measured: dict) -> list[dict]:
    """One row per case: prediction, what each rank held at its peak moment, the worse error."""
    from tests.distributed.test_memory_accuracy import CASES

    rows = []
    for zero, pp in CASES:
        key = f"zero{zero}-pp{pp}"
        params, states = predicted(zero, pp)
        held = [max(measured[rank][key]["moments"].values()) for rank in sorted(measured)]
        error = max(((states.peak - h) / h for h in held), key=abs)  # the rank the prediction misses most
        rows.append({"case": f"ZeRO-{zero}, pp {pp}, dp {2 // pp}", "zero": zero, "pp": pp, "stage_params": params,
                     "predicted_bytes": states.peak, "predicted_parts": states.to_dict(), "measured_bytes": held,
                     "measured_params": [measured[rank][key]["params"] for rank in sorted(measured)],
                     "moments": {rank: measured[rank][key]["moments"] for rank in sorted(measured)},
                     "error": error})
    return rows


def markdown(rows: list[dict]) -> list[str]:
    lines = ["| case | parameters per rank | predicted (MiB) | measured rank 0 / 1 (MiB) | error |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        held = " / ".join(f"{b / MiB:.2f}" for b in r["measured_bytes"])
        lines.append(f"| {r['case']} | {r['stage_params']:,} | {r['predicted_bytes'] / MiB:.2f} | {held} | "
                     f"{_pct(r['error'])} |")
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", "Model states (parameters, gradients, fp32 master weights, Adam states, ZeRO reduction buckets) "
              "of 8 x Linear(512, 512) in fp32 with torch's AdamW on 2 CPU processes (gloo), "
              "`reduce_bucket_size` 100k. Measured: distinct tensor storages a real engine holds at the larger of "
              "two moments of the second step (see tests/distributed/test_memory_accuracy.py). "
              f"Predicted: `toolkit.plan.memory.model_state_bytes(...).peak`. Worst error {worst:.1%} (target: within 5%)."]
    return lines


def _pct(x: float) -> str:
    return f"{x if abs(x) >= 5e-4 else 0.0:+.1%}"  # no "-0.0%" for a few bytes under


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", metavar="DIR", help="write the ranks' raw JSON here (default: a temp dir)")
    args = parser.parse_args()
    from tests.distributed.test_memory_accuracy import _launch

    out_dir = Path(args.keep or tempfile.mkdtemp(prefix="dstk-plan-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table(_launch(out_dir))  # {rank: {case: {"params", "moments"}}}
    path = write_result("plan", {"model": "8 x Linear(512, 512), fp32, AdamW (torch_adam)", "world_size": 2,
                                 "rows": rows})
    lines = markdown(rows)
    write_markdown("plan", "Planner accuracy: model-state bytes per rank (CPU)", lines)
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
