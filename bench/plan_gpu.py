"""Predicted peak memory (`dstk plan`'s estimate) vs torch.cuda.max_memory_allocated for real training
steps on one CUDA GPU (issue 5: within 15%). Skips, exit 0, without CUDA.

    DS_ACCELERATOR=cuda .venv/bin/python bench/plan_gpu.py [--gpu h100-sxm] [--out bench/results/plan_gpu.json]

Each case: the HF model (random weights, bf16, sdpa attention) under deepspeed.initialize, world of 1
(dp = pp = 1), ZeRO-0 or 1, torch's AdamW ("torch_adam": no JIT build), 3 steps of random tokens; the
estimate is toolkit.plan.layouts.planner.estimate_layout(...).allocated for the same layout (model states +
activations with the loss's peak; without the CUDA context and NCCL buffers, which max_memory_allocated does
not see). A case that fails is recorded with its error, the others
still run, and the exit status is 1.

Long-sequence cases (LONG_CASES): llama-3.2-1b's widths with a few blocks, one row of 16K or 32K tokens (one
document filling it: no mask, rows="full"), bf16, ZeRO-1, activation checkpointing, dstk's tiled loss and TiledMLP,
all through dstk's own code paths as toolkit.train.engine applies them at pp 1 (HF's gradient checkpointing,
models.tiled.loss.patch_causal_lm, models.tiled.mlp.patch_mlps, models.attention.model_inputs); the estimate is the
same layout with checkpointing, --tiled-loss on and --tiled-mlp on (and --offload-activations on for the case that
offloads the checkpoints, next to the same case without). `--dry-run` prints every case's estimate
without CUDA (what CI checks on CPU).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [("gpt2", 1024, 4, 0), ("gpt2", 1024, 4, 1), ("llama-3.2-1b", 2048, 2, 0), ("llama-3.2-1b", 2048, 2, 1)]
LONG_CASES = [("llama-3.2-1b", 4, 16384, False), ("llama-3.2-1b", 4, 32768, False),  # (widths of, blocks, tokens,
               ("llama-3.2-1b", 8, 32768, False), ("llama-3.2-1b", 8, 32768, True)]  # checkpoints offloaded): mbs 1


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


def long_config(name: str, blocks: int):
    """The HF config of `name`'s widths with `blocks` decoder blocks, sdpa attention."""
    from dataclasses import replace

    from toolkit.plan.arch import load_arch, to_hf_config

    config = to_hf_config(replace(load_arch(name), layers=blocks))
    config._attn_implementation = "sdpa"
    return config


def measure_long(name: str, blocks: int, seq: int, offload: bool = False) -> int:
    """Peak bytes allocated over 3 training steps of one `seq`-token row (one document) under DeepSpeed ZeRO-1,
    bf16, with checkpointing, the tiled loss and TiledMLP applied as toolkit.train.engine does at pp 1; `offload`:
    each step's forward and backward inside models.tiled.offload.host_offload (--offload-activations on), as
    toolkit.train.loop does."""
    import contextlib

    import deepspeed
    import torch
    import transformers

    from models.attention import model_inputs, share_additive_masks
    from models.generic import LogitTransform
    from models.tiled.loss import patch_causal_lm
    from models.tiled.mlp import patch_mlps, widths
    from models.tiled.offload import host_offload

    config = long_config(name, blocks)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patch_causal_lm(model, LogitTransform(config))
    patch_mlps(model, widths(config)[0])
    share_additive_masks(model.config)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    before = torch.cuda.memory_allocated()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        ids = torch.randint(0, config.vocab_size, (1, seq))
        inputs = {k: v.to(engine.device) if torch.is_tensor(v) else v
                  for k, v in model_inputs(torch.ones_like(ids), model.config).items()}
        ids = ids.to(engine.device)
        with host_offload() if offload else contextlib.nullcontext():
            engine.backward(engine(input_ids=ids, labels=ids, **inputs).loss)
        engine.step()
    peak = torch.cuda.max_memory_allocated() - before
    engine.destroy()
    del engine, model
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return peak


def predict_long(name: str, blocks: int, seq: int, offload: bool, gpu: str) -> int:
    """The planner's allocated bytes for measure_long's run (its config saved to a temporary directory)."""
    import tempfile

    from toolkit.plan.layouts.estimate import Layout
    from toolkit.plan.layouts.planner import PlanRequest, estimate_layout

    with tempfile.TemporaryDirectory(prefix="dstk-plan-gpu-") as folder:
        long_config(name, blocks).save_pretrained(folder)
        req = PlanRequest(model=folder, gbs=1, gpus_per_node=1, gpu=gpu, seq_len=seq, precision="bf16", rows="full",
                          tiled_loss="on", tiled_mlp="on", offload_activations="on" if offload else "off")
        return estimate_layout(req, Layout(pp=1, dp=1, zero=1, mbs=1, gas=1, checkpointing=True)).allocated


def predict(name: str, seq: int, mbs: int, zero: int, gpu: str) -> int:
    from toolkit.plan.layouts.planner import PlanRequest, estimate_layout
    from toolkit.plan.layouts.estimate import Layout

    req = PlanRequest(model=name, gbs=mbs, gpus_per_node=1, gpu=gpu, seq_len=seq, precision="bf16")
    return estimate_layout(req, Layout(pp=1, dp=1, zero=zero, mbs=mbs, gas=1)).allocated


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--gpu", default="h100-sxm", help="preset for the estimate's throughput (memory unused)")
    args.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_gpu.json"))
    args.add_argument("--dry-run", action="store_true", help="print each case's estimate; measure nothing (no CUDA)")
    opts = args.parse_args()
    cases = [({"model": name, "seq_len": seq, "mbs": mbs, "zero": zero}, (measure, (name, seq, mbs, zero)),
              (predict, (name, seq, mbs, zero, opts.gpu))) for name, seq, mbs, zero in CASES]
    cases += [({"model": f"{name} widths, {blocks} blocks", "seq_len": seq, "mbs": 1, "zero": 1,
                "long": "checkpointing, tiled loss, TiledMLP" + (", checkpoints offloaded" if offload else "")},
               (measure_long, (name, blocks, seq, offload)), (predict_long, (name, blocks, seq, offload, opts.gpu)))
              for name, blocks, seq, offload in LONG_CASES]
    if opts.dry_run:
        for row, _, (fn, fn_args) in cases:
            print(f"{row['model']:30} seq {row['seq_len']} mbs {row['mbs']} zero {row['zero']}: predicted "
                  f"{fn(*fn_args) / 2**30:.2f} GiB")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("plan_gpu: skipped, no CUDA device")
        return 0
    from toolkit.distributed import process_group

    process_group.init()  # a world of one on a free port (nccl on CUDA)
    rows = []
    for row, (run, run_args), (fn, fn_args) in cases:
        name, seq, mbs, zero = row["model"], row["seq_len"], row["mbs"], row["zero"]
        try:  # one case's failure (out of memory, a DeepSpeed error) is reported; the others still run
            measured, predicted = run(*run_args), fn(*fn_args)
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
