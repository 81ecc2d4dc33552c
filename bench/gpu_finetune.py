"""Single-GPU fine-tuning: tokens/s, model FLOPs utilisation and peak memory of dstk's path vs the same
HF model under plain deepspeed.initialize, for GPT-2 124M and a ~1B Llama-style model (llama-3.2-1b's
shape, random weights, no hub), bf16, ZeRO 1 and 2. Skips, exit 0, without CUDA.

    bench/gpu.sh                                          # plan_gpu.py, this, report.py (CUDA only)
    .venv/bin/python bench/gpu_finetune.py [--quick] [--gpu h100-sxm] [--fused-adam]
    .venv/bin/python bench/gpu_finetune.py --dry-run      # same code on CPU: tiny models, 2 steps, gloo

dstk: the config from toolkit.config.generate.build_config (what `dstk generate-config --world-size 1
--mbs M --gbs M --zero Z --precision bf16` writes), the HF model under deepspeed.initialize (dstk's pp = 1
path). plain: a hand-written minimal config (micro-batch, bf16, ZeRO stage, AdamW). Both get the same
model (sdpa attention, bf16 weights), the same tokens, and the same optimizer: torch's AdamW
("torch_adam": no JIT build, no nvcc needed) unless --fused-adam (DeepSpeed's FusedAdam, a JIT build on
first use). Rounds alternate the order (dstk, plain, plain, dstk, ...); each case builds its engine,
runs warm-up steps, times the rest, records torch.cuda.max_memory_allocated above what was allocated
before it was built, and frees it.

MFU = tokens/s * (6N + 12 L s h_attn) / the GPU's dense bf16 peak (toolkit.plan.gpus, matched from
torch.cuda.get_device_name(); --gpu to choose). N: parameters that take part in matmuls (all but a
learned position table; a tied embedding counted once, as the LM head); 12 L s h_attn: attention
scores and weighted sum, forward and backward, without the causal saving (PaLM's convention).
Predicted peak: bench/plan_gpu.predict (toolkit.plan.planner's estimate for the layout). Writes
bench/results/gpu.json and gpu.md (--dry-run: into a temporary directory, never over real figures).
"""

import argparse
import gc
import os
import re
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]
import common  # noqa: E402

GPU_MODELS = {"gpt2": (1024, 8), "llama-3.2-1b": (2048, 4)}  # name -> (seq_len, mbs): 8192 tokens a step
DRY_MODELS = {"tiny-gpt2": (64, 2), "tiny-llama": (64, 2)}
PATHS = ("dstk", "plain")
LR = 1e-4
# torch.cuda.get_device_name() (lower case) -> toolkit.plan.gpus preset; the first match wins. None: a card
# with no preset (H100 NVL: 835 dense bf16 TFLOPs, not the SXM's 989); give --gpu or --peak-tflops.
DEVICE_NAMES = [(r"h200", "h200"), (r"h100.*nvl", None), (r"h100.*pcie", "h100-pcie"), (r"h100", "h100-sxm"),
                (r"a100.*pcie.*80|a100.*80.*pcie", "a100-pcie-80gb"), (r"a100.*40", "a100-40gb"),
                (r"a100", "a100-80gb"), (r"\bl4\b", "l4"), (r"a10g", "a10g"), (r"v100.*16", "v100-16gb"),
                (r"v100", "v100-32gb"), (r"4090", "rtx-4090")]


def match_gpu(device_name: str) -> str | None:
    """The toolkit.plan.gpus preset for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm"), or None."""
    for pattern, preset in DEVICE_NAMES:
        if re.search(pattern, device_name.lower()):
            return preset
    return None


def flops_per_token(name: str, seq_len: int) -> float:
    """Training FLOPs per token: 6N (forward 2N, backward 4N) + 12 L s h_attn (attention, non-causal count)."""
    from toolkit.plan.arch import load_arch

    arch = load_arch(name)
    matmul_params = arch.num_params() - (arch.max_positions * arch.hidden if arch.learned_positions else 0)
    return 6 * matmul_params + 12 * arch.layers * seq_len * arch.heads * arch.head_dim


def dstk_config(mbs: int, zero: int, fused: bool) -> dict:
    """What `dstk generate-config --world-size 1 --mbs M --gbs M --zero Z --precision bf16 [--cpu]` writes."""
    from toolkit.config.generate import build_config
    from toolkit.config.options import GenerateOptions

    return build_config(GenerateOptions(world_size=1, mbs=mbs, gbs=mbs, zero=zero, precision="bf16", lr=LR,
                                        cpu=not fused, steps_per_print=10**6))


def plain_config(mbs: int, zero: int, fused: bool) -> dict:
    """The minimal config a user writes by hand for the same run."""
    params = {"lr": LR} if fused else {"lr": LR, "torch_adam": True}
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": zero}, "optimizer": {"type": "AdamW", "params": params},
            "steps_per_print": 10**6}


def build_engine(name: str, config: dict, device):
    """The HF causal LM (random weights from seed 0, bf16, sdpa) under deepspeed.initialize."""
    import deepspeed
    import torch
    import transformers

    from toolkit.plan.arch import load_arch, to_hf_config

    torch.manual_seed(0)
    with torch.device(device):  # initialised in place: no 5 GB trip through host memory for the 1B model
        model = transformers.AutoModelForCausalLM.from_config(to_hf_config(load_arch(name)), dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    params = [p for p in model.parameters() if p.requires_grad]  # as toolkit.train.loop.prepare passes them
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def run_case(name: str, seq: int, mbs: int, config: dict, steps: int, warmup: int, device) -> dict:
    """Build, warm up, time `steps` optimizer steps, free. Seconds per step; peak bytes on CUDA."""
    import torch

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0  # what earlier cases left behind, if anything
    engine = build_engine(name, config, device)
    ids = torch.randint(0, engine.module.config.vocab_size, (mbs, seq),
                        generator=torch.Generator().manual_seed(1)).to(engine.device)  # (mbs, seq)
    times, loss = timed_steps(engine, ids, steps, warmup)
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    out = {"step_s": times, "loss": loss, "peak_bytes": peak, "allocated_before_bytes": before}
    ref = weakref.ref(engine)
    engine.destroy()  # without it autograd hooks keep the engine, and its states stay on the GPU, for good
    del engine
    gc.collect()
    out["engine_freed"] = ref() is None
    if not out["engine_freed"]:
        print("  warning: the engine outlived destroy(); later peaks are measured above what it holds")
    return out


def timed_steps(engine, ids, steps: int, warmup: int) -> tuple[list[float], float]:
    """Seconds of each optimizer step after `warmup` untimed ones (device synchronised), and the last loss."""
    from deepspeed.accelerator import get_accelerator

    times = []
    for i in range(warmup + steps):
        get_accelerator().synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        get_accelerator().synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, loss.item()


def measure(name: str, seq: int, mbs: int, zero: int, opts, device) -> dict:
    """Both paths, alternating order round by round; per path every step time and the largest peak."""
    configs = {"dstk": dstk_config(mbs, zero, opts.fused_adam), "plain": plain_config(mbs, zero, opts.fused_adam)}
    runs = {path: [] for path in PATHS}
    for r in range(opts.rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            runs[path].append(run_case(name, seq, mbs, configs[path], opts.steps, opts.warmup, device))
            last = runs[path][-1]
            peak = f", peak {_gib(last['peak_bytes'])} GiB" if last["peak_bytes"] else ""
            print(f"  {name} ZeRO-{zero} {path:5} round {r + 1}: {statistics.median(last['step_s']) * 1e3:.1f} "
                  f"ms/step, loss {last['loss']:.3f}{peak}", flush=True)
    return {"configs": configs, "runs": runs}


def summarize(name: str, seq: int, mbs: int, zero: int, measured: dict, peak_tflops: float | None, preset: str) -> dict:
    """Tokens/s from the median step over all rounds, MFU, peak memory against the planner's estimate."""
    from plan_gpu import predict

    fpt = flops_per_token(name, seq)
    predicted = predict(name, seq, mbs, zero, preset)
    paths = {}
    for path, runs in measured["runs"].items():
        step = statistics.median(t for run in runs for t in run["step_s"])
        peaks = [run["peak_bytes"] for run in runs if run["peak_bytes"] is not None]
        peak = max(peaks) if peaks else None
        paths[path] = {"median_step_s": step, "tokens_per_s": mbs * seq / step,
                       "mfu": mbs * seq / step * fpt / (peak_tflops * 1e12) if peak_tflops else None,
                       "peak_bytes": peak, "predicted_bytes": predicted,
                       "predicted_error": predicted / peak - 1 if peak else None, "runs": runs}
    return {"model": name, "seq_len": seq, "mbs": mbs, "zero": zero, "flops_per_token": fpt,
            "dstk_over_plain": paths["dstk"]["tokens_per_s"] / paths["plain"]["tokens_per_s"], "paths": paths,
            "configs": measured["configs"]}


def markdown(meta: dict, cases: list) -> list[str]:
    lines = [f"GPU: **{meta['gpu']}** (peak {meta['peak_tflops'] or '?'} dense bf16 TFLOPs, preset "
             f"{meta['preset']}); optimizer: {meta['optimizer']}; {meta['rounds']} alternating rounds of "
             f"{meta['warmup']} warm-up + {meta['steps']} timed steps per path.", "",
             "| model | seq x mbs | ZeRO | path | tokens/s | MFU | peak (GiB) | planner (GiB) | planner error |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for c in cases:
        for path, p in c["paths"].items():
            lines.append(f"| {c['model']} | {c['seq_len']} x {c['mbs']} | {c['zero']} | {path} | "
                         f"{p['tokens_per_s']:,.0f} | {_fmt(p['mfu'], '.1%')} | {_gib(p['peak_bytes'])} | "
                         f"{_gib(p['predicted_bytes'])} | {_fmt(p['predicted_error'], '+.1%')} |")
    lines += ["", "dstk / plain tokens/s: " + ", ".join(f"{c['model']} ZeRO-{c['zero']} {c['dstk_over_plain']:.3f}"
                                                      for c in cases),
              "", "MFU counts 6N + 12 L s h_attn FLOPs per token (see bench/gpu_finetune.py). Peak: "
              "`torch.cuda.max_memory_allocated` over build and steps; planner: `toolkit.plan.planner.estimate_layout`."]
    return lines + plan_gpu_lines(meta["gpu"])


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)  # "-": no CUDA (dry run) or no GPU preset


def _gib(n) -> str:
    return _fmt(None if n is None else n / 2**30, ".2f")


def plan_gpu_lines(gpu_name: str) -> list[str]:
    """bench/plan_gpu.py's table (ZeRO 0/1 peak vs planner), when gpu.sh ran it on this GPU just before."""
    import json

    path = common.RESULTS / "plan_gpu.json"
    if not path.exists() or json.loads(path.read_text()).get("gpu") != gpu_name:
        return []
    lines = ["", "Planner peak memory, `bench/plan_gpu.py` on the same GPU (target: within 15%):", "",
             "| model | seq x mbs | ZeRO | measured (GiB) | predicted (GiB) | error |", "|---|---|---:|---:|---:|---:|"]
    for c in json.loads(path.read_text())["cases"]:
        lines.append(f"| {c['model']} | {c['seq_len']} x {c['mbs']} | {c['zero']} | {_gib(c['measured_bytes'])} | "
                     f"{_gib(c['predicted_bytes'])} | {c['error']:+.1%} |")
    return lines


def setup(opts):
    """(device, device name, toolkit.plan.gpus preset, peak bf16 TFLOPs) with a world of one up; None without CUDA."""
    if opts.dry_run:  # the CPU path even where a GPU exists
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    from toolkit import dist
    from toolkit.plan.gpus import get_gpu

    if not torch.cuda.is_available() and not opts.dry_run:
        return None
    dist.init()  # nccl on CUDA, gloo on CPU; no JIT-built comm op
    if opts.dry_run:
        device, name, preset = torch.device("cpu"), "CPU (dry run)", opts.gpu or "h100-sxm"
    else:
        torch.cuda.set_device(0)
        device, name = torch.device("cuda", 0), torch.cuda.get_device_name(0)
        preset = opts.gpu or match_gpu(name)
    peak = opts.peak_tflops or (get_gpu(preset).tflops("bf16") if preset else None)
    return device, name, preset, peak


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, 2 steps: check the script")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 + 5 steps (default: 2 rounds of 3 + 10)")
    parser.add_argument("--models", nargs="+", metavar="NAME", help=f"default: {' '.join(GPU_MODELS)} "
                        f"(dry run: {' '.join(DRY_MODELS)})")
    parser.add_argument("--zero", nargs="+", type=int, choices=(0, 1, 2, 3), default=[1, 2])
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int, help="timed optimizer steps per case and round")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--gpu", metavar="PRESET",
                        help="toolkit.plan.gpus preset for the peak (default: matched from the device name)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak, overriding the preset")
    parser.add_argument("--fused-adam", action="store_true", help="DeepSpeed's FusedAdam (JIT build) in both paths")
    parser.add_argument("--out-dir", help="where results go (default: bench/results; dry run: a temp dir)")
    opts = parser.parse_args(argv)
    rounds, warmup, steps = (1, 1, 2) if opts.dry_run else (1, 2, 5) if opts.quick else (2, 3, 10)
    opts.rounds = rounds if opts.rounds is None else opts.rounds
    opts.warmup = warmup if opts.warmup is None else opts.warmup
    opts.steps = steps if opts.steps is None else opts.steps
    opts.models = opts.models or list(DRY_MODELS if opts.dry_run else GPU_MODELS)
    return opts


def save(meta: dict, cases: list) -> list[str]:
    """JSON and the BENCHMARKS.md fragment, rewritten after every case so a cut-short run keeps its figures."""
    common.write_result("gpu", {**meta, "cases": cases})
    lines = markdown(meta, cases)
    common.write_markdown("gpu", f"GPU fine-tuning: dstk vs plain DeepSpeed ({meta['gpu']})", lines)
    return lines


def main(argv=None) -> int:
    opts = parse_args(argv)
    ctx = setup(opts)
    if ctx is None:
        print("gpu_finetune: skipped: no CUDA (use --dry-run to check the script on CPU)")
        return 0
    device, gpu_name, preset, peak = ctx
    if opts.out_dir or opts.dry_run:  # common writes under RESULTS: point it away from the real figures
        common.RESULTS = Path(opts.out_dir or tempfile.mkdtemp(prefix="dstk-gpu-dry-run-"))
    sizes = {**GPU_MODELS, **DRY_MODELS}
    meta = {"gpu": gpu_name, "preset": preset, "peak_tflops": peak, "dry_run": opts.dry_run,
            "optimizer": "DeepSpeed FusedAdam" if opts.fused_adam else "torch AdamW (torch_adam)",
            "rounds": opts.rounds, "warmup": opts.warmup, "steps": opts.steps}
    print(f"gpu_finetune: {meta}", flush=True)
    cases, start = [], time.perf_counter()
    for name in opts.models:
        seq, mbs = sizes[name]
        for zero in opts.zero:
            measured = measure(name, seq, mbs, zero, opts, device)
            cases.append(summarize(name, seq, mbs, zero, measured, peak, preset or "h100-sxm"))
            lines = save(meta, cases)
    print("\n".join(lines))
    print(f"gpu_finetune: {time.perf_counter() - start:.0f} s; wrote {common.RESULTS / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
