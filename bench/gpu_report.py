"""bench/gpu_finetune.py's results: gpu.json (every case, gpu.sh's steps), the BENCHMARKS.md fragment
gpu.md, and one line per case as it finishes."""

import json

import common


def markdown(meta: dict, cases: list) -> list[str]:
    lines = [f"GPU: **{meta['gpu']}** (peak {meta['peak_tflops'] or '?'} dense bf16 TFLOPs, toolkit.plan.gpus "
             f"preset {meta['preset']}); `dstk train --model DIR`, DIR: {meta['model']}'s shape "
             f"({meta['matmul_params'] / 1e6:,.1f} M parameters in matmuls, byte tokenizer) with random weights saved "
             f"in bf16 by save_pretrained; seq {meta['seq_len']}, bf16, {meta['optimizer']}; {meta['warmup']} "
             f"warm-up + {meta['steps']} timed steps per case, each through `launch.sh`.", "",
             "| case | GPUs | pp x dp | ZeRO | mbs x gas | attention | data | tokens/s | MFU | peak (GiB) | "
             "dstk plan (GiB) | plan error | loss first -> last |",
             "|---|---:|---|---:|---|---|---|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        head = (f"| {c['name']} | {c['pp'] * c['dp']} | {c['pp']} x {c['dp']} | {c['zero']} | {c['mbs']} x {c['gas']} "
                f"| {c['attention']}{' + ' + c['adapters'] if c['adapters'] else ''} | {c['data']} |")
        if c["status"] != "ok":
            lines.append(f"{head} {c['status']}: {c['reason']} |" + " - |" * 5)
            continue
        lines.append(f"{head} {_fmt(c['tokens_per_s'], ',.0f')} | {_fmt(c['mfu'], '.1%')} | "
                     f"{_gib(c['peak_gpu_bytes'])} | {_gib(c['predicted_bytes'])} | {_fmt(c['predicted_error'], '+.1%')} "
                     f"| {c['first_loss']:.3f} -> {c['last_loss']:.3f} |")
    lines += ["", "MFU: tokens/s x FLOPs per token (the planner's cost model, toolkit.plan.cost.mfu: 6N + attention's "
              "12 L s h_attn; LoRA's frozen weights without weight gradients) / (the case's GPUs x peak). Peak: the "
              "largest rank's `torch.cuda.max_memory_allocated` (the run's summary); dstk plan: "
              "`toolkit.plan.layouts.planner.estimate_layout` for the same layout (none for QLoRA: it has no 4-bit base). "
              "A failed case's log tail is in gpu.json."]
    failed = [f"{s['name']} ({s['detail']})" for s in meta.get("script_steps", []) if s["status"] != "ok"]
    if failed:
        lines += ["", "**Steps that failed:** " + "; ".join(failed) + "."]
    return lines + plan_gpu_lines(meta)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)  # "-": no CUDA (dry run) or no GPU preset


def _gib(n) -> str:
    return _fmt(None if n is None else n / 2**30, ".2f")


def plan_gpu_lines(meta: dict) -> list[str]:
    """bench/plan_gpu.py's table (ZeRO 0/1 peak vs planner), when gpu.sh ran it on this GPU just before
    and it did not fail."""
    path = common.RESULTS / "plan_gpu.json"
    ran = {s["name"]: s["status"] for s in meta.get("script_steps", [])}
    if ran.get("plan_gpu.py") != "ok" or not path.exists() or json.loads(path.read_text()).get("gpu") != meta["gpu"]:
        return []
    lines = ["", "Planner peak memory, `bench/plan_gpu.py` on the same GPU (target: within 15%):", "",
             "| model | seq x mbs | ZeRO | measured (GiB) | predicted (GiB) | error |", "|---|---|---:|---:|---:|---:|"]
    for c in json.loads(path.read_text())["cases"]:
        error = _fmt(c.get("error"), "+.1%") if "failed" not in c else f"failed: {c['failed']}"
        lines.append(f"| {c['model']} | {c['seq_len']} x {c['mbs']} | {c['zero']} | {_gib(c.get('measured_bytes'))} | "
                     f"{_gib(c.get('predicted_bytes'))} | {error} |")
    return lines


def save(meta: dict, cases: list) -> list[str]:
    """JSON and the BENCHMARKS.md fragment, rewritten after every case so a cut-short run keeps its figures."""
    common.write_result("gpu", {**meta, "cases": cases})
    lines = markdown(meta, cases)
    common.write_markdown("gpu", f"GPU fine-tuning through `dstk train` ({meta['gpu']})", lines)
    return lines


def record_steps(steps: list[dict]) -> int:
    """Add gpu.sh's later steps to the gpu.json this run wrote (a bare one when none was written)."""
    path = common.RESULTS / "gpu.json"
    result = json.loads(path.read_text()) if path.exists() else {"cases": []}
    result["script_steps"] = result.get("script_steps", []) + steps
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def report_case(c: dict) -> None:
    if c["status"] == "failed":
        print(f"  {c['name']}: FAILED ({c['reason']}, {c['wall_s']} s); last lines of {c['log']}:\n{c['log_tail']}",
              flush=True)
        return
    mem = f", peak {_gib(c['peak_gpu_bytes'])} GiB (plan {_gib(c['predicted_bytes'])})" if c["peak_gpu_bytes"] else ""
    print(f"  {c['name']}: {_fmt(c['tokens_per_s'], ',.0f')} tokens/s, MFU {_fmt(c['mfu'], '.1%')}{mem}, "
          f"loss {c['first_loss']:.3f} -> {c['last_loss']:.3f}, {c['wall_s']} s", flush=True)
