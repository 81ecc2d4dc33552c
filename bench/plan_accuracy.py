"""Planner accuracy on CPU: model-state bytes per rank that toolkit.plan.memory predicts vs what real DeepSpeed
engines hold, for ZeRO 0/1/2/3 at pp 1 (dp 2) and ZeRO 0/1 at pp 2 (dp 1); and with LoRA (peft adapters of
rank 8 on every Linear, the base frozen) at ZeRO 1/3 with pp 1 (dp 2) and ZeRO 0/1 with pp 2 (dp 1).

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


def predicted(zero: int, pp: int, lora: int | None = None):
    """(stage parameters, of which trainable, toolkit.plan.memory's ModelStates) for one rank of the test's
    model: its stage is LAYERS / pp layers; with `lora`, their adapters are all that trains."""
    from tests.distributed.test_memory_accuracy import BUCKET, stage_counts
    from toolkit.plan.memory import model_state_bytes

    params, trainable = stage_counts(pp, lora)
    return params, trainable, model_state_bytes(params, dp=2 // pp, zero=zero, precision="fp32", optimizer="adam",
                                                pipeline=pp > 1, reduce_bucket_size=BUCKET, trainable=trainable)


def cases() -> list[tuple]:
    """(key in the ranks' JSON, zero, pp, LoRA rank or None) of every measured engine."""
    from tests.distributed.test_memory_accuracy import CASES, LORA_CASES, LORA_R

    return [(f"zero{z}-pp{p}", z, p, None) for z, p in CASES] + \
        [(f"lora-zero{z}-pp{p}", z, p, LORA_R) for z, p in LORA_CASES]


def table(measured: dict) -> list[dict]:
    """One row per case: prediction, what each rank held at its peak moment, the worse error."""
    ranks = sorted(measured)
    rows = []
    for key, zero, pp, lora in cases():
        params, trainable, states = predicted(zero, pp, lora)
        held = [max(measured[rank][key]["moments"].values()) for rank in ranks]
        error = max(((states.peak - h) / h for h in held), key=abs)  # the rank the prediction misses most
        name = f"ZeRO-{zero}, pp {pp}, dp {2 // pp}" + (f", LoRA r={lora}" if lora else "")
        rows.append({"case": name, "zero": zero, "pp": pp, "lora_r": lora, "stage_params": params,
                     "trainable_params": trainable, "predicted_bytes": states.peak,
                     "predicted_parts": states.to_dict(), "measured_bytes": held,
                     "measured_params": [measured[rank][key]["params"] for rank in ranks],
                     "measured_trainable": [measured[rank][key].get("trainable") for rank in ranks],
                     "moments": {rank: measured[rank][key]["moments"] for rank in ranks}, "error": error})
    return rows


def markdown(rows: list[dict]) -> list[str]:
    lines = ["| case | parameters per rank (trainable) | predicted (MiB) | measured rank 0 / 1 (MiB) | error |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        held = " / ".join(f"{b / MiB:.2f}" for b in r["measured_bytes"])
        lines.append(f"| {r['case']} | {r['stage_params']:,} ({r['trainable_params']:,}) | "
                     f"{r['predicted_bytes'] / MiB:.2f} | {held} | {_pct(r['error'])} |")
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", "Model states (parameters, gradients, fp32 master weights, Adam states, ZeRO reduction buckets) "
              "of 8 x Linear(512, 512) in fp32 with torch's AdamW on 2 CPU processes (gloo), "
              "`reduce_bucket_size` 100k; LoRA rows: peft adapters of rank 8 on every Linear, the base frozen, only "
              "the adapters given to the optimizer. Measured: distinct tensor storages a real engine holds at the "
              "largest of its moments in the second step (after a backward, before the optimizer step, and for "
              "ZeRO-1 at the boundary reduction; see tests/distributed/test_memory_accuracy.py). "
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
    path = write_result("plan", {"model": "8 x Linear(512, 512), fp32, AdamW (torch_adam); LoRA rows: peft r=8",
                                 "world_size": 2, "rows": rows})
    lines = markdown(rows)
    write_markdown("plan", "Planner accuracy: model-state bytes per rank (CPU)", lines)
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
