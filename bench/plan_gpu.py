"""Predicted peak memory (`dstk plan`'s estimate) vs torch.cuda.max_memory_allocated for real training
steps on one CUDA GPU (issue 5: within 15%). Skips, exit 0, without CUDA.

    DS_ACCELERATOR=cuda .venv/bin/python bench/plan_gpu.py [--gpu h100-sxm] [--out bench/results/plan_gpu.json]

Each case: the HF model (random weights, bf16, sdpa attention) under deepspeed.initialize, world of 1
(dp = pp = 1), ZeRO-0 or 1, torch's AdamW ("torch_adam": no JIT build), 3 steps of random tokens; the
estimate is toolkit.plan.layouts.planner.estimate_layout(...).allocated for the same layout (model states +
activations with the loss's peak; without the CUDA context and NCCL buffers, which max_memory_allocated does
not see). A case that fails is recorded with its error, the others
still run, and the exit status is 1.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [("gpt2", 1024, 4, 0), ("gpt2", 1024, 4, 1), ("llama-3.2-1b", 2048, 2, 0), ("llama-3.2-1b", 2048, 2, 1)]


def measure(name: str, seq: int, mbs: int, zero: int) -> int:
    """Peak bytes allocated over 3 training steps of `name` under DeepSpeed."""
    import deepspeed
    import torch
    import transformers

    from toolkit.plan.arch import load_arch, to_hf_config

    config = to_hf_config(load_arch(name))
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ds = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": zero}, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    before = torch.cuda.memory_allocated()  # what earlier cases left behind, if anything
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        ids = torch.randint(0, config.vocab_size, (mbs, seq), device=engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    peak = torch.cuda.max_memory_allocated() - before
    engine.destroy()  # autograd hooks keep an engine alive after `del`: free it before the next case
    del engine, model
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return peak


def predict(name: str, seq: int, mbs: int, zero: int, gpu: str) -> int:
    from toolkit.plan.layouts.planner import PlanRequest, estimate_layout
    from toolkit.plan.layouts.estimate import Layout

    req = PlanRequest(model=name, gbs=mbs, gpus_per_node=1, gpu=gpu, seq_len=seq, precision="bf16")
    return estimate_layout(req, Layout(pp=1, dp=1, zero=zero, mbs=mbs, gas=1)).allocated


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--gpu", default="h100-sxm", help="preset for the estimate's throughput (memory unused)")
    args.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_gpu.json"))
    opts = args.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("plan_gpu: skipped, no CUDA device")
        return 0
    from toolkit.distributed import process_group

    process_group.init()  # a world of one on a free port (nccl on CUDA)
    rows = []
    for name, seq, mbs, zero in CASES:
        row = {"model": name, "seq_len": seq, "mbs": mbs, "zero": zero}
        try:  # one case's failure (out of memory, a DeepSpeed error) is reported; the others still run
            measured, predicted = measure(name, seq, mbs, zero), predict(name, seq, mbs, zero, opts.gpu)
        except Exception as exc:
            rows.append({**row, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
            import gc

            gc.collect()  # what the failed case left on the GPU, before the next
            torch.cuda.empty_cache()
            print(f"{name:14} seq {seq} mbs {mbs} zero {zero}: FAILED: {rows[-1]['failed']}", flush=True)
            continue
        rows.append({**row, "measured_bytes": measured, "predicted_bytes": predicted, "error": predicted / measured - 1})
        print(f"{name:14} seq {seq} mbs {mbs} zero {zero}: measured {measured / 2**30:.2f} GiB, "
              f"predicted {predicted / 2**30:.2f} GiB ({predicted / measured - 1:+.1%})", flush=True)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "cases": rows}, indent=2))
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
