"""bench/gpu_finetune.py's results: gpu.json (every case, gpu.sh's steps), the BENCHMARKS.md fragment
gpu.md, and one line per case as it finishes."""

import json

import common


def markdown(meta: dict, cases: list) -> list[str]:
    lines = [f"GPU: **{meta['gpu']}** (peak {meta['peak_tflops'] or '?'} dense bf16 TFLOPs, toolkit.plan.gpus "
             f"preset {meta['preset']}); `dstk train --model DIR`, DIR: {meta['model']}'s shape "
             f"({meta['matmul_params'] / 1e6:,.1f} M parameters in matmuls, byte tokenizer) with random weights saved "
             f"in bf16 by save_pretrained; seq {meta['seq_len']}, bf16, {meta['optimizer']}; {meta['warmup']} "
             f"warm-up + {meta['steps']} timed steps per case, each through `launch.sh` (HF Trainer's: DeepSpeed's "
             "launcher).", "",
             "| case | GPUs | pp x dp | ZeRO | mbs x gas | attention | data | tokens/s | MFU | peak (GiB) | "
             "dstk plan (GiB) | plan error | loss first -> last |",
             "|---|---:|---|---:|---|---|---|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        head = (f"| {c['name']} | {c['pp'] * c['dp']} | {c['pp']} x {c['dp']} | {c['zero']} | {c['mbs']} x {c['gas']} "
                f"| {c['attention']}{' + ' + c['adapters'] if c['adapters'] else ''}"
                f"{' + AutoEP ep ' + str(c['ep']) + ' (MoE model)' if c.get('ep') else ''} | {c['data']} |")
        if c["status"] != "ok":
            lines.append(f"{head} {c['status']}: {c['reason']} |" + " - |" * 5)
            continue
        lines.append(f"{head} {_fmt(c['tokens_per_s'], ',.0f')} | {_fmt(c['mfu'], '.1%')} | "
                     f"{_gib(c['peak_gpu_bytes'])} | {_gib(c['predicted_bytes'])} | {_fmt(c['predicted_error'], '+.1%')} "
                     f"| {c['first_loss']:.3f} -> {c['last_loss']:.3f} |")
    lines += ["", "MFU: tokens/s x FLOPs per token (the planner's cost model, toolkit.plan.cost.mfu: 6N + attention's "
              "12 L s h_attn; LoRA's frozen weights without weight gradients) / (the case's GPUs x peak). Peak: the "
              "largest rank's `torch.cuda.max_memory_allocated` in training (the run's summary: counted from just "
              "before the first step; the load's peak is in gpu.json); dstk plan: "
              "`toolkit.plan.layouts.planner.estimate_layout` for the same layout (none for QLoRA: it has no 4-bit base). "
              "A failed case's log tail is in gpu.json. pp1-zero1-hf: pp1-zero1 under transformers' Trainer "
              "(bench/hf_trainer.py), compared below."]
    lines += anchor_lines(meta, cases)
    failed = [f"{s['name']} ({s['detail']})" for s in meta.get("script_steps", []) if s["status"] != "ok"]
    if failed:
        lines += ["", "**Steps that failed:** " + "; ".join(failed) + "."]
    return lines + plan_gpu_lines(meta)


SAME = ("pp", "dp", "zero", "mbs", "gas", "adapters", "attention", "data")  # what an HF case and its dstk case share


def anchor_lines(meta: dict, cases: list) -> list[str]:
    """dstk against HF Trainer, for each HF case and the dstk case of the same layout: rates, peaks and loss
    side by side, with their ratio (dstk / HF Trainer); a line saying why where either did not finish."""
    lines = []
    for hf in (c for c in cases if c.get("trainer") == "hf"):
        ours = next((c for c in cases if c.get("trainer", "dstk") == "dstk" and all(c[k] == hf[k] for k in SAME)), None)
        if ours is None or "ok" != ours["status"] or "ok" != hf["status"]:
            why = "; ".join(f"{c['name']} {c['status']}: {c.get('reason')}" for c in (ours, hf)
                            if c and c["status"] != "ok")
            lines += ["", f"**dstk vs HF Trainer:** not compared ({why or 'no dstk case of that layout'})."]
            continue
        lines += ["", f"**dstk vs HF Trainer** ({ours['name']} / {hf['name']}, one run each, back to back; the steps "
                  f"after the {meta['warmup']} warm-up ones):", "",
                  "| | dstk | HF Trainer | dstk / HF Trainer |", "|---|---:|---:|---:|"]
        trained = [hf["timed_targets"] / c["timed_seconds"] if hf.get("timed_targets") and c.get("timed_seconds")
                   else None for c in (ours, hf)]  # the same rows: the same targets in both runs' timed steps
        lines += [_row("tokens/s (row positions, padding included)", ours["tokens_per_s"], hf["tokens_per_s"], ",.0f"),
                  _row("trained tokens/s (positions with a loss target)", *trained, ",.0f"),
                  _row("rows/s", ours.get("rows_per_s"), hf.get("rows_per_s"), ",.2f")]
        lines += [_row(label, _gib_of(ours.get(key)), _gib_of(hf.get(key)), ".2f") for label, key in (
            ("peak GPU memory in training (GiB)", "peak_gpu_bytes"),
            ("peak GPU memory at load (GiB)", "load_peak_gpu_bytes"))]
        lines.append(f"| loss, first -> last step | {_losses(ours)} | {_losses(hf)} | |")
        lines += ["", anchor_note(hf)]
    return lines


def anchor_note(hf: dict) -> str:
    positions = hf["timed_steps"] * hf["gbs"] * hf["seq_len"]
    padding = f"{hf['timed_padding'] / positions:.1%}" if hf.get("timed_padding") is not None and positions else "?"
    return ("Both train the same tokens: the same DeepSpeed config file, model directory, sequence length and batch, "
            "and the same rows in the same order (bench/hf_trainer.py reads them with dstk's data preparation and "
            "sampler and gives HF the packed-sequence inputs dstk's forward passes). tokens/s counts every position "
            f"of every row (gbs x seq per step), padding included ({padding} of the timed positions are padding: "
            "dstk's next-fit packing pads a row's end where the next document does not fit); trained tokens/s "
            "counts the positions the loss is taken on; rows/s the rows. dstk's step time is its optimizer step (fetching its micro-batches, forward, "
            "backward, step, the loss read back); HF Trainer's runs from one on_step_end to the next after a CUDA "
            "sync (its batch fetch and per-step logging included). Peak memory: torch.cuda.max_memory_allocated "
            "from the start of training (reset once the engine is built), the load's peak beside it. Ratios: dstk's "
            "figure over HF Trainer's (rates above 1: dstk faster; memory below 1: dstk holds less).")


def _row(label: str, ours, theirs, spec: str) -> str:
    ratio = "-" if ours is None or not theirs else f"{ours / theirs:.3f}x"
    return f"| {label} | {_fmt(ours, spec)} | {_fmt(theirs, spec)} | {ratio} |"


def _losses(c: dict) -> str:
    return f"{_fmt(c.get('first_loss'), '.3f')} -> {_fmt(c.get('last_loss'), '.3f')}"


def _gib_of(n):
    return None if n is None else n / 2**30


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
