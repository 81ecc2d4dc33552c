"""Planner accuracy on CPU, two tables.

Model states: bytes per rank that toolkit.plan.memory.rank predicts vs what real DeepSpeed engines hold, for ZeRO
0/1/2/3 at pp 1 (dp 2) and ZeRO 0/1 at pp 2 (dp 1); and with LoRA (peft adapters of rank 8 on every Linear, the
base frozen) at ZeRO 1/3 with pp 1 (dp 2) and ZeRO 0/1 with pp 2 (dp 1). The measuring is
tests/distributed/test_memory_accuracy.py's (run, not copied): one launch of 2 CPU processes on gloo (forked by
tests/ranks.py, with the deepspeed launcher's variables), a stack of 8 Linear(512, 512) layers in fp32 with torch's AdamW, each engine's distinct tensor
storages summed at its peak moment.

Activations and the loss: the peak bytes one forward + backward of a HF causal LM allocates (what dstk runs
at pp 1: `model(input_ids, labels=...).loss.backward()`), less the parameters' gradients (model states: every
parameter-shaped storage, a tied weight's two parts and transposed ones included), against
toolkit.plan.cost.layers' activations + loss peak at pp 1, and against the planner before 21f721c (4 x tokens x vocab
bytes for the loss). Real widths of built-in architectures with fewer blocks, random weights, bf16, sdpa, dropout
off (with it, CPU's sdpa falls back to its math path and keeps the attention probabilities), no attention mask
(is_causal; the planner's per-block mask term is left out of the prediction). Measured with a torch dispatch
mode that follows every storage the ops create (one process).

    .venv/bin/python bench/plan_accuracy.py [--part states|activations]   # a few minutes on 2 cores

Bytes are deterministic, so there are no repetitions. Writes bench/results/plan.json and plan.md.
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
    """(stage parameters, of which trainable, toolkit.plan.memory.rank's ModelStates) for one rank of the test's
    model: its stage is LAYERS / pp layers; with `lora`, their adapters are all that trains."""
    from tests.distributed.test_memory_accuracy import BUCKET, stage_counts
    from toolkit.plan.memory.rank import model_state_bytes

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
              f"Predicted: `toolkit.plan.memory.rank.model_state_bytes(...).peak`. Worst error {worst:.1%} (target: within 5%)."]
    return lines


# (name in toolkit.plan.arch.BUILTINS, blocks, seq_len, mbs): the loss large (llama's 128k vocabulary) or not
ACT_CASES = [("gpt2", 2, 512, 2), ("llama-3.2-1b", 1, 256, 1), ("llama-3.2-1b", 4, 512, 1), ("qwen2.5-0.5b", 2, 512, 1)]


class _Timeline:
    """A torch dispatch mode recording, after every op, the bytes of the storages ops created that are alive
    and which ones (an id per storage: freed addresses are reused), so a peak can leave some out afterwards."""

    def __new__(cls):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.alive, self.size, self.shape, self.live, self.points = {}, {}, {}, 0, []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                         if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
                    if ptr is not None and ptr not in self.alive and ptr not in given:  # new, not a view
                        self.alive[ptr] = len(self.size)
                        self.shape[len(self.size)] = tuple(t.shape)
                        self.size[len(self.size)] = t.untyped_storage().nbytes()
                        self.live += t.untyped_storage().nbytes()
                        weakref.finalize(t.untyped_storage(), self._free, ptr)
                self.points.append((self.live, frozenset(self.alive.values())))
                return out

            def _free(self, ptr):
                self.live -= self.size[self.alive.pop(ptr)]

        return Mode()


def activation_case(name: str, blocks: int, seq: int, mbs: int) -> dict:
    """Measured and predicted peak bytes of one pp 1 forward + backward (module docstring)."""
    from dataclasses import replace

    import torch
    import transformers

    from toolkit.plan.arch import BUILTINS, to_hf_config
    from toolkit.plan.cost.layers import layer_costs, logits_bytes

    arch = replace(BUILTINS[name], layers=blocks)
    config = to_hf_config(arch)
    config._attn_implementation = "sdpa"
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout"):  # off: under dropout CPU's sdpa
        if hasattr(config, key):  # takes the math path and keeps (B, a, T, T) probabilities GPU kernels do not
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.randint(0, arch.vocab, (mbs, seq))
    with _Timeline() as mode:
        model(input_ids=ids, labels=ids).loss.backward()
    # parameter-shaped storages are gradients (model states): the weights' own, a tied weight's second part,
    # a transposed one; no activation has such a shape here (tokens per micro-batch differ from every width)
    shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(reversed(p.shape)))}
    grads = {i for i, shape in mode.shape.items() if shape in shapes}
    measured = max(live - sum(mode.size[i] for i in alive & grads) for live, alive in mode.points)
    costs = layer_costs(arch, seq, mbs, "bf16", attention="sdpa")
    held = sum(c.act_bytes for c in costs) - logits_bytes(arch, seq, mbs, 2)  # pp 1: HF's logits dropped
    nv = mbs * seq * arch.vocab
    return {"case": f"{name} widths, {blocks} block(s), vocab {arch.vocab:,}, {mbs} x {seq} tokens",
            "measured_bytes": measured, "predicted_bytes": held + costs[-1].peak_bytes,
            "predicted_before_bytes": held + 4 * nv, "loss_peak_bytes": costs[-1].peak_bytes,
            "tokens_x_vocab": nv}


def activation_markdown(rows: list[dict]) -> list[str]:
    lines = ["| case | measured (MiB) | planner before (MiB) | planner now (MiB) | before / measured | "
             "now / measured |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["measured_bytes"]
        lines.append(f"| {r['case']} | {m / MiB:.1f} | {r['predicted_before_bytes'] / MiB:.1f} | "
                     f"{r['predicted_bytes'] / MiB:.1f} | {r['predicted_before_bytes'] / m:.2f} | "
                     f"{r['predicted_bytes'] / m:.2f} |")
    return lines + ["", "Peak bytes one forward + backward allocates (one CPU process, bf16, sdpa, no dropout, "
                    "no mask), less the parameters' gradients; predicted: toolkit.plan.cost.layers' activations at pp 1 + the loss's peak "
                    "(12 x tokens x vocab bytes: the fp32 log-softmax, its gradient and the logits' gradient); "
                    "before: the same activations + 4 x tokens x vocab (the fp32 log-softmax alone)."]


def _pct(x: float) -> str:
    return f"{x if abs(x) >= 5e-4 else 0.0:+.1%}"  # no "-0.0%" for a few bytes under


def _launch(out_dir: Path) -> dict:
    """{rank: {case: ...}}: test_memory_accuracy.py's engines on 2 ranks (tests/ranks.py forks them, as the
    deepspeed launcher would start them), each writing OUT_DIR/rank<R>.json."""
    import json

    from tests.distributed.launch import run_script

    run_script(ROOT / "tests" / "distributed" / "test_memory_accuracy.py", out_dir, num_procs=2)
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", metavar="DIR", help="write the ranks' raw JSON here (default: a temp dir)")
    parser.add_argument("--part", choices=("all", "states", "activations"), default="all",
                        help="measure one table only")
    args = parser.parse_args()
    payload, lines = {"world_size": 2}, []
    if args.part in ("all", "states"):
        out_dir = Path(args.keep or tempfile.mkdtemp(prefix="dstk-plan-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = table(_launch(out_dir))  # {rank: {case: {"params", "moments"}}}
        payload.update(model="8 x Linear(512, 512), fp32, AdamW (torch_adam); LoRA rows: peft r=8", rows=rows)
        lines += ["### Model states per rank (2 CPU processes)", ""] + markdown(rows)
    if args.part in ("all", "activations"):
        rows = [activation_case(*case) for case in ACT_CASES]
        payload["activation_rows"] = rows
        lines += ["", "### Activations and the loss's peak, pp 1 (one CPU process)", ""] + activation_markdown(rows)
    path = write_result("plan", payload)
    write_markdown("plan", "Planner accuracy on CPU: model states per rank, activations and the loss's peak", lines)
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
