"""The run's summary and what is made from OUT/metrics.jsonl (one JSON line per step, the summary last),
so it can be redrawn for any finished or interrupted run: the per-rank numbers (per_rank), throughput
(tokens/s, and MFU on CUDA: mfu_fields), the short loss table and OUT/loss.png.
"""

import json
from pathlib import Path


def read_metrics(path) -> tuple[list, dict | None]:
    """(step records, the last summary or None) from a metrics.jsonl."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    summaries = [r["summary"] for r in records if "summary" in r]
    return [r for r in records if "step" in r], (summaries[-1] if summaries else None)


def _number(value, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else " " * (width - 1) + "-"


def table(steps: list, summary: dict | None) -> str:
    """The first step, every evaluated step and the last one: step, loss, eval loss, tokens/s."""
    lines = ["step    loss    eval  tokens/s"]
    for r in steps:
        if r is steps[-1] and summary:  # the final eval runs after the last step: it is in the summary
            r = dict(r, eval_loss=summary.get("eval_loss"))
        if r is steps[0] or r is steps[-1] or "eval_loss" in r:
            lines.append(f"{r['step']:>4}  {_number(r['loss'], 6, 3)}  {_number(r.get('eval_loss'), 6, 3)}  "
                         f"{_number(r.get('tokens_per_s'), 8, 0)}")
    if summary and summary.get("first_loss") is not None:
        evaluated = f", eval {summary['eval_loss']:.3f}" if summary.get("eval_loss") is not None else ""
        lines.append(f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}{evaluated}, "
                     f"{summary['tokens_per_s']:.0f} tokens/s{_mfu_text(summary)}, {summary['seconds']:.0f} s")
    return "\n".join(lines)


def _mfu_text(summary: dict) -> str:
    """", MFU 41.2% (1 GPU x h200, 989 bf16 TFLOPs)" on a GPU (a dash and the reason when it cannot be counted);
    nothing on CPU (a summary without "gpu", or from before MFU was recorded)."""
    if not summary.get("gpu"):
        return ""
    value = "-" if summary.get("mfu") is None else f"{summary['mfu']:.1%}"
    return f", MFU {value} ({summary.get('mfu_note')})"


def throughput(step_seconds: list, tokens_per_step: int, rows_per_step: int, warmup: int = 1) -> dict:
    """The summary's steady-state rates: tokens_per_s (row positions, padding included, as each step record
    counts them) and samples_per_s (rows) over this run's steps after its first `warmup` (the first step
    pays for kernel selection, allocator growth and lazy set-up: not the rate the run trains at), their
    tokens over their summed seconds; timed_steps and warmup_steps say which. A run of `warmup` steps or
    fewer times them all (warmup_steps 0)."""
    warmup = warmup if len(step_seconds) > warmup else 0
    timed = step_seconds[warmup:]
    seconds = sum(timed)
    if seconds <= 0:
        return {"tokens_per_s": 0.0, "samples_per_s": 0.0, "timed_steps": 0, "warmup_steps": warmup}
    n = len(timed)
    return {"tokens_per_s": tokens_per_step * n / seconds, "samples_per_s": rows_per_step * n / seconds,
            "timed_steps": n, "warmup_steps": warmup}


def mfu_fields(tokens_per_s: float, model_config: dict, run, precision: str, gpu: str | None, gpus: int) -> dict:
    """The summary's throughput fields: flops_per_token (toolkit.plan.cost.mfu: the planner's cost model of the
    model in `model_config`, a HF config.json dict, at run.seq_len, with run.lora_r under --lora/--qlora),
    gpu (the CUDA device name, or None), mfu (share of `gpus` x the preset peak of `precision` that
    `tokens_per_s` used; None off CUDA or where it cannot be counted) and mfu_note (what it was measured
    against, or why there is none)."""
    from toolkit.errors import ConfigError
    from toolkit.plan.arch import arch_from_config
    from toolkit.plan.cost.mfu import flops_per_token, peak_tflops, utilisation

    out = {"flops_per_token": None, "gpu": gpu, "mfu": None}
    if run.task != "causal-lm":
        return {**out, "mfu_note": f"FLOPs are counted for causal LMs only, not --task {run.task}"}
    try:
        arch = arch_from_config(model_config, run.model)
        out["flops_per_token"] = flops_per_token(arch, run.seq_len, run.lora_r if run.lora or run.qlora else None)
        if gpu is None:
            return {**out, "mfu_note": "no CUDA device: MFU is measured against a GPU's peak"}
        preset, tflops = peak_tflops(gpu, precision)
    except ConfigError as exc:  # an architecture the planner cannot cost, a GPU without a preset
        return {**out, "mfu_note": str(exc)}
    gpu_word = "GPU" if gpus == 1 else "GPUs"
    return {**out, "mfu": utilisation(tokens_per_s, out["flops_per_token"], gpus, tflops),
            "mfu_note": f"{gpus} {gpu_word} x {preset}, {tflops:g} {precision} TFLOPs"}


def run_throughput(summary: dict, job, args) -> dict:
    """mfu_fields for this rank's engine: the run's HF config as saved in the checkpoint folder, its
    precision, its CUDA device (None on CPU), the world size."""
    import torch.distributed as dist

    from toolkit.checkpoint.manifest import META

    engine, saved = job.engine, Path(job.ckpt_dir) / META / "config.json"
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    gpu = None
    if engine.device.type == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(engine.device)
    if not saved.is_file():
        return {"flops_per_token": None, "gpu": gpu, "mfu": None, "mfu_note": f"no {saved} to count FLOPs from"}
    fields = mfu_fields(summary["tokens_per_s"], json.loads(saved.read_text()), args, precision, gpu,
                        dist.get_world_size())
    if precision == "fp32" and gpu is not None and (job.about or {}).get("tf32"):  # not the fp32 peak's to judge
        fields.update(mfu=None, mfu_note="fp32 on TF32 tensor cores (--tf32): toolkit.plan.gpus holds no TF32 peak "
                                         "to measure MFU against")
    return fields


def draw_loss_png(steps: list, summary: dict | None, path) -> dict:
    """Training loss per step (and eval loss where taken) as a PNG at `path`; the summary's fields:
    {"loss_png": "PATH"}, or where matplotlib cannot be imported {"loss_png": None, "loss_png_skipped": why},
    nothing drawn. The curve is optional (a GPU image may lack matplotlib): the run's summary, export and
    exit status never depend on it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {"loss_png": None, "loss_png_skipped": f"matplotlib is not importable ({type(exc).__name__}: {exc}); "
                                                      "pip install matplotlib to draw it"}
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss", linewidth=1)
    evals = [(r["step"], r["eval_loss"]) for r in steps if r.get("eval_loss") is not None]
    if summary and summary.get("eval_loss") is not None and steps:
        evals.append((steps[-1]["step"], summary["eval_loss"]))
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return {"loss_png": str(path)}


def per_rank(engine, load: dict | None = None) -> dict:
    """Per global rank, in one gather: the parameter elements its module holds (a pipeline stage: its
    own layers; ZeRO-3: placeholders hold 0) and how many of them train; the model-state MiB the
    engine holds at the end (toolkit.train.report.footprint: weights, gradients, masters, optimizer states); the
    most memory (MiB) held in training, from just before its first step (report.memory): host (resident
    set) and GPU (torch.cuda.max_memory_allocated; None off CUDA); and, from `load` (what
    memory.reset_peaks returned then), the same two peaks up to that point: loading the model, data and
    engine (load_peak_*; None when not given)."""
    import torch.distributed as dist

    from toolkit.train.report.footprint import held_bytes
    from toolkit.train.report.memory import gpu_peak_mib, host_peak_mib

    params = [p for p in engine.module.parameters()]
    gpu = gpu_peak_mib(engine.device)
    load = load or {}
    mine = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
            round(held_bytes(engine) / 2**20, 2), round(host_peak_mib(), 1), None if gpu is None else round(gpu, 1),
            load.get("host_mib"), load.get("gpu_mib"))
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    keys = ("params_per_rank", "trainable_params_per_rank", "model_state_mib_per_rank", "peak_rss_mib_per_rank",
            "peak_gpu_mib_per_rank", "load_peak_rss_mib_per_rank", "load_peak_gpu_mib_per_rank")
    return {key: [r[i] for r in out] for i, key in enumerate(keys)}
