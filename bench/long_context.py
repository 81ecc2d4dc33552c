"""Long sequences under Ulysses sequence parallelism: the longest sequence that trains per rank at sp = 1, 2
and 4 within one activation-memory budget, tokens/s against sp = 1 at one common length, and what `dstk plan`'s
estimator predicted for both; then where the planner puts dstk's GPU path against ALST (arXiv 2506.13996:
Llama-3.1-8B, 500K tokens on one H100, 3.7M on 8).

    python bench/long_context.py                       # ~10 minutes on 2 cores
    python bench/long_context.py --budget-mib 256 --sps 1 2 4 --reps 3

Model: a small Llama built here (hidden 256, 2 blocks, 8 heads, 4 key/value heads, max positions 2^20), random
weights, the byte tokenizer, fp32, ZeRO-1, mbs 1, gas 1, dp 1 (world = sp), one document per row: every run is
`launch.sh` like a user's. Memory: the peak resident set the run logs (peak_mem_mib, the largest over ranks)
less that of a 512-token run of the same layout (the process, model and optimizer states): the activations'
share, what sp divides. Lengths double from 1024 while that share stays within --budget-mib. The planner's
prediction is its estimate's activation bytes for the same layout (toolkit.plan.layouts: pp 1, ZeRO-1, fp32).
Throughput: median per-step tokens/s of --reps runs of each sp at one length, alternated sp 1, 2, 4, 1, 2, 4, ...
(processes > cores here: sp 4 runs 4 ranks on 2 cores, so its tokens/s says what 4 ranks cost on 2 cores).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import launch, write_markdown, write_result  # noqa: E402

ARCH = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "intermediate_size": 688, "max_position_embeddings": 2**20}
BASE_LEN = 512
GiB, MiB = 2**30, 2**20


def build_model(folder: Path) -> Path:
    """The small Llama of ARCH with the byte tokenizer, saved as a HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.train.hf import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **ARCH)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def corpus(path: Path, length: int, rows: int) -> Path:
    """`rows` documents of `length` + 64 bytes of words, blank-line separated: one truncated row each."""
    import random

    rng = random.Random(length)
    words = ["the", "pipeline", "stage", "sends", "tokens", "attention", "heads", "gradient", "sequence", "rank"]
    docs = []
    for _ in range(rows):
        text = []
        while sum(map(len, text)) + len(text) < length + 64:
            text.append(rng.choice(words))
        docs.append(" ".join(text))
    path.write_text("\n\n".join(docs) + "\n")
    return path


def run(model: Path, sp: int, length: int, steps: int, tmp: Path, flags: tuple = (), config: dict | None = None,
        threads: int = 1) -> dict | None:
    """One `launch.sh` run of sp ranks at `length` tokens per row (`flags` more for dstk train, `config` more for its
    DeepSpeed config, `threads` per rank): metrics of its steps, None when it failed."""
    name = f"sp{sp}_{length}_{len(list(tmp.iterdir()))}"
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 1}, "steps_per_print": 10**6, **(config or {})}
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    data = corpus(tmp / f"{name}.txt", length, steps + 1)
    cmd = ["bash", str(REPO / "launch.sh"), "--num-gpus", str(sp), "--config", str(tmp / f"{name}.json"), "--",
           "--model", str(model), "--data", str(data), "--seq-len", str(length), "--steps", str(steps),
           "--eval-fraction", "0", "--no-export", "--no-progress", "--out", str(tmp / name), *flags]
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    rc, _ = launch(cmd, tmp / f"{name}.log", env, timeout=1800)
    metrics = tmp / name / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        print(f"  sp {sp} at {length} tokens failed (exit {rc}); log: {tmp / f'{name}.log'}", flush=True)
        return None
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    return {"peak_mib": max(r["peak_mem_mib"] for r in records),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:] or records)}


def predicted_activations(model: Path, sp: int, length: int) -> int:
    """The planner's activation bytes for this layout (pp 1, dp 1, sp, ZeRO-1, mbs 1, fp32, no checkpointing)."""
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    result = make_plan(PlanRequest(model=str(model), gpus_per_node=sp, gbs=1, seq_len=length, precision="fp32",
                                   gpu_mem=2**50, tflops=1.0, checkpointing=False, offload=False))
    return next(e.activations for e in result.fitting
                if (e.layout.pp, e.layout.sp, e.layout.zero, e.layout.tp) == (1, sp, 1, 1))


def longest(model: Path, sp: int, budget: int, cap: int, steps: int, tmp: Path) -> dict:
    """Double the length from 1024 while the measured activation share stays within `budget` bytes."""
    base = run(model, sp, BASE_LEN, steps, tmp)
    if base is None:
        return {"sp": sp, "status": "failed at the base length"}
    tried, best, length = [], None, 1024
    while length <= cap:
        got = run(model, sp, length, steps, tmp)
        share = None if got is None else (got["peak_mib"] - base["peak_mib"]) * MiB
        tried.append({"length": length, "activation_mib": None if share is None else share / MiB,
                      "predicted_mib": predicted_activations(model, sp, length) / MiB,
                      "tokens_per_s": None if got is None else got["tokens_per_s"]})
        print(f"  sp {sp}: {length} tokens -> {tried[-1]}", flush=True)
        if got is None or share > budget:
            break
        best, length = length, length * 2
    predicted = max((t["length"] for t in tried if t["predicted_mib"] * MiB <= budget), default=None)
    return {"sp": sp, "longest": best, "predicted_longest": predicted, "base_peak_mib": base["peak_mib"],
            "tried": tried, "status": "ok"}


def throughput(model: Path, sps: list, length: int, reps: int, steps: int, tmp: Path) -> dict:
    """Median per-step tokens/s of each sp at one length, the runs alternated."""
    samples = {sp: [] for sp in sps}
    for _ in range(reps):
        for sp in sps:
            got = run(model, sp, length, steps, tmp)
            samples[sp].append(None if got is None else got["tokens_per_s"])
    out = {}
    for sp, values in samples.items():
        ok = [v for v in values if v is not None]
        out[sp] = {"runs": values, "median_tokens_per_s": statistics.median(ok) if ok else None,
                   "failed": len(values) - len(ok)}
    base = out[sps[0]]["median_tokens_per_s"]
    for r in out.values():
        r["ratio_to_sp1"] = r["median_tokens_per_s"] / base if base and r["median_tokens_per_s"] else None
    return out


def alst_comparison(tmp: Path) -> list:
    """The longest sequence (a power-of-two multiple of 16K tokens) `dstk plan` fits for Llama-3.1-8B (rope
    scaled to 4M positions, as ALST runs it) on 1 and on 8 H100 80GB, any layout, bf16, checkpointing and offload
    allowed, gbs = dp: what dstk's GPU path would train per the planner, next to ALST's measured 500K and 3.7M."""
    from dataclasses import replace

    from toolkit.plan.arch import load_arch
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    arch = replace(load_arch("llama-3-8b"), name="llama-3.1-8b-4M", max_positions=4 * 2**20)
    folder = tmp / "llama-3.1-8b"
    folder.mkdir(exist_ok=True)
    config = {"model_type": "llama", "hidden_size": arch.hidden, "num_hidden_layers": arch.layers,
              "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
              "intermediate_size": arch.intermediate, "vocab_size": arch.vocab, "max_position_embeddings": arch.max_positions,
              "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    rows = []
    for gpus, alst in ((1, 500_000), (8, 3_700_000)):
        best, short, length = None, None, 16384
        while length <= 4 * 2**20:
            result = make_plan(PlanRequest(model=str(folder), gpus_per_node=gpus, gpu="h100", gbs=1, seq_len=length))
            if not result.fitting:  # the least memory there, and what of it is the loss's peak (the logits)
                short = {"length": length, "memory_gib": result.closest.memory / GiB,
                         "activations_gib": result.closest.activations / GiB,
                         "loss_peak_gib": result.closest.loss_peak / GiB, "layout": str(result.closest.layout)}
                break
            best = {"length": length, "layout": str(result.fitting[0].layout),
                    "memory_gib": result.fitting[0].memory / GiB}  # fastest first
            length *= 2
        rows.append({"gpus": gpus, "alst_tokens": alst, "dstk_planned": best, "next_length": short})
    return rows


def markdown(meta: dict, lengths: list, speed: dict, alst: list) -> list:
    lines = [f"Model: small Llama (hidden {ARCH['hidden_size']}, {ARCH['num_hidden_layers']} blocks, "
             f"{ARCH['num_attention_heads']} heads, {ARCH['num_key_value_heads']} kv heads), fp32, ZeRO-1, mbs 1, one "
             f"document per row. Activation budget per rank: {meta['budget_mib']} MiB (peak RSS above a "
             f"{BASE_LEN}-token run of the same layout). {meta['cpus']} CPUs, one thread per rank; load average "
             f"{meta['load'][0]:.1f} before, {meta['load'][1]:.1f} after.", "",
             "| sp | ranks | longest trained within budget | planner's longest | measured activations there | "
             "planner's activations there |", "|---|---|---|---|---|---|"]
    for r in lengths:
        if r["status"] != "ok":
            lines.append(f"| {r['sp']} | {r['sp']} | failed: {r['status']} | | | |")
            continue
        at = next((t for t in r["tried"] if t["length"] == r["longest"]), None)
        lines.append(f"| {r['sp']} | {r['sp']} | {r['longest']} | {r['predicted_longest']} | "
                     + (f"{at['activation_mib']:.0f} MiB | {at['predicted_mib']:.0f} MiB |" if at else "- | - |"))
    base = lengths[0].get("longest")
    if base:
        lines += ["", "Longest sequence against sp 1: " + ", ".join(
            f"sp {r['sp']} {r['longest'] / base:.1f}x" for r in lengths if r.get("longest"))]
    ratios = [(r["sp"], t["activation_mib"] / t["predicted_mib"]) for r in lengths if r["status"] == "ok"
              for t in r["tried"] if t["length"] == r["longest"] and t["activation_mib"]]
    if ratios:
        lines += ["", "Measured / planner's activations at the longest length: " + ", ".join(
            f"sp {sp} {ratio:.2f}" for sp, ratio in ratios) + ". At sp 1 the planner counts one fp32 (seq x seq) mask "
            "for the model (pp 1 shares one additive mask among the layers), which HF does not build for unpadded "
            "one-document rows (sdpa's causal path): there it over-counts; under sp it counts no mask and its "
            "per-token shortfall shows: it promises about twice the length that fits."]
    lines += ["", f"Throughput at {meta['speed_length']} tokens per row, median of {meta['reps']} runs each, alternated:",
              "", "| sp | tokens/s (median) | against sp 1 | runs | failed |", "|---|---|---|---|---|"]
    for sp, r in speed.items():
        ratio = f"{r['ratio_to_sp1']:.2f}" if r["ratio_to_sp1"] else "-"
        med = f"{r['median_tokens_per_s']:.0f}" if r["median_tokens_per_s"] else "failed"
        lines.append(f"| {sp} | {med} | {ratio} | {', '.join('-' if v is None else f'{v:.0f}' for v in r['runs'])} | "
                     f"{r['failed']} |")
    lines += ["", "ALST (arXiv 2506.13996) against dstk's GPU path as `dstk plan` sizes it (Llama-3.1-8B, H100 80GB, bf16, "
              "any layout it plans (sp included), activation checkpointing and offload allowed):", "",
              "| GPUs | ALST measured | dstk, planner's longest | its layout | twice that needs (least-memory layout) | "
              "of which the loss's peak |", "|---|---|---|---|---|---|"]
    for r in alst:
        best, short = r["dstk_planned"], r["next_length"]
        lines.append(f"| {r['gpus']} | {r['alst_tokens'] / 1e6:.1f}M | "
                     + (f"{best['length'] / 2**10:.0f}K ({best['memory_gib']:.0f} GiB) | {best['layout']} | " if best
                        else "none fits at 16K | | ")
                     + (f"{short['memory_gib']:.0f} GiB | {short['loss_peak_gib']:.0f} GiB |" if short else "- | - |"))
    lines += ["", "The planner counts dstk train's defaults: the tiled loss (--tiled-loss auto, models.tiled.loss: three "
              "tiles of logits at the loss's peak instead of (seq / sp) x vocab logits in fp32 and their softmax; "
              "bench/tiled_loss.py measures it) and DeepSpeed's TiledMLP (--tiled-mlp auto, models.tiled.mlp: one "
              "shard's MLP intermediates). ALST also offloads checkpointed activations to the host, which dstk does "
              "not do yet."]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--cap", type=int, default=65536, help="longest length tried")
    parser.add_argument("--speed-length", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="dstk-long-") as name:
        tmp = Path(name)
        runs = tmp / "runs"
        runs.mkdir()
        model = build_model(tmp / "model")
        lengths = [longest(model, sp, args.budget_mib * MiB, args.cap, args.steps, runs) for sp in args.sps]
        speed = throughput(model, args.sps, args.speed_length, args.reps, args.steps, runs)
        alst = alst_comparison(tmp)
    load.append(os.getloadavg()[0])
    meta = {"budget_mib": args.budget_mib, "speed_length": args.speed_length, "reps": args.reps, "load": load,
            "cpus": os.cpu_count()}
    write_result("long_context", {"meta": meta, "longest": lengths, "throughput": speed, "alst": alst})
    lines = markdown(meta, lengths, speed, alst)
    write_markdown("long_context", "Long sequences: Ulysses sp on CPU, and the planner against ALST", lines)
    print("\n".join(lines))
    failed = any(r["status"] != "ok" for r in lengths) or any(r["failed"] for r in speed.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
