"""LoRA vs full fine-tuning of the same model in the same layout: model-state bytes and peak RSS per rank,
tokens/s, as ratios LoRA / full from one run that alternates the two (lora, full, lora, full, ...).

    .venv/bin/python bench/lora_vs_full.py                          # pp 2, dp 1: 3 x 2 runs x 12 steps: ~6 min, 2 CPUs
    .venv/bin/python bench/lora_vs_full.py --repeats 1 --steps 4 --warmup 1    # run_all --quick
    .venv/bin/python bench/lora_vs_full.py --pp 1 --procs 2         # another layout (dp = procs / pp)
    .venv/bin/python bench/lora_vs_full.py --dry-run                # print the configs and commands, run nothing

Model: a llama-style decoder (MODEL below, ~25M parameters, random weights from seed 0) saved with
save_pretrained as a local HF directory, the byte tokenizer beside it, so a pipeline stage reads its own
tensors from disk (the path users take). Each run is `dstk train` through launch.sh, as
bench/train_scaling.py launches it: fp32, torch's AdamW, seq 128, mbs 2 x gas 4 per replica, one thread
per process, the shipped corpus, no eval, no export. LoRA: `--lora --lora-r 16`, default targets (every
linear in the blocks). Per run, from rank 0's OUT/metrics.jsonl: the median of the per-step tokens/s
after `--warmup` steps, and the summary's per-rank lists (model_state_mib_per_rank: what the engine holds
for weights, gradients, fp32 masters and optimizer states at the end; peak_rss_mib_per_rank; trainable
parameters). Reported: medians over the repeats and the ratios LoRA / full. Beside them, when `dstk plan`
has `--lora`, its model-state prediction for the same layout (toolkit.plan.layouts.planner.estimate_layout, the
stage holding the most). Any failed run fails the benchmark (exit 1, the failure in the output and in
results/lora.md). Writes bench/results/lora.json (every run) and bench/results/lora.md.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]
import common  # noqa: E402
from common import launch  # noqa: E402  (the launcher wrapper, not copied)
from gpu_finetune import DIST_VARS, read_metrics  # noqa: E402

CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
SEQ, MBS, GAS, LORA_R, LR = 128, 2, 4, 16, 1e-4
# transformers.LlamaConfig fields: 8 blocks of hidden 512 -> 25.6M parameters with the byte tokenizer's 257 rows
MODEL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)
CASES = ("lora", "full")  # alternated in this order every repeat; ratios are lora / full


class BenchFailed(RuntimeError):
    """A run failed or measured nothing: the benchmark reports it and exits 1, with no table."""


def build_model(path: Path) -> int:
    """Save the random llama-style model and the byte tokenizer to `path`; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from toolkit.train.hf import byte_tokenizer

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def ds_config(pp: int) -> dict:
    """fp32, torch's AdamW, no clipping, DeepSpeed's step prints off (as bench/train_scaling.py)."""
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
            "pipeline": {"stages": pp}, "steps_per_print": 10**6}


def train_command(case: str, procs: int, config: Path, model: Path, out: Path, steps: int) -> list[str]:
    """launch.sh ... -- <dstk train args> for one run of `case` ("lora" or "full")."""
    cmd = ["bash", str(REPO / "launch.sh"), "--num-gpus", str(procs), "--config", str(config), "--",
           "--model", str(model), "--data", str(CORPUS), "--seq-len", str(SEQ), "--steps", str(steps),
           "--eval-fraction", "0", "--no-export", "--no-progress", "--out", str(out)]
    return cmd + (["--lora", "--lora-r", str(LORA_R)] if case == "lora" else [])


def child_env() -> dict:
    """This environment less any rank variables; one thread per process (as bench/train_scaling.py)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return env


def measure(records: list[dict], summary: dict | None, warmup: int) -> dict:
    """One run's figures from rank 0's metrics: median per-step tokens/s after `warmup`, the per-rank lists."""
    rates = [r["tokens_per_s"] for r in records if r["step"] > warmup]
    if summary is None or not rates:
        raise BenchFailed(f"no {'summary' if summary is None else 'steps after the warm-up'} in metrics.jsonl "
                          f"({len(records)} step records, --warmup {warmup})")
    keys = ("params_per_rank", "trainable_params_per_rank", "model_state_mib_per_rank", "peak_rss_mib_per_rank",
            "peak_gpu_mib_per_rank")
    return {"tokens_per_s": statistics.median(rates), "steps_timed": len(rates), "step_tokens_per_s": rates,
            **{k: summary.get(k) for k in keys}}


def run_one(case: str, n: int, ctx: dict) -> dict:
    """Launch one run; its figures, or BenchFailed with the tail of its log."""
    out, log = ctx["work"] / f"{case}-{n}", ctx["work"] / f"{case}-{n}.log"
    cmd = train_command(case, ctx["procs"], ctx["config"], ctx["model"], out, ctx["steps"])
    rc, wall = launch(cmd, log, child_env(), ctx["timeout"])
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the trainer saves one at the last step
    if rc != 0:
        why = f"timed out after {ctx['timeout']:.0f} s" if rc is None else f"exit code {rc}"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise BenchFailed(f"{case} run {n} failed ({why}): {' '.join(cmd)}\n{tail}")
    try:
        figures = measure(*read_metrics(out), ctx["warmup"])
    except BenchFailed as exc:
        raise BenchFailed(f"{case} run {n}: {exc}") from None
    return {"case": case, "repeat": n, "wall_s": round(wall, 1), **figures}


def per_rank_median(runs: list[dict], key: str) -> list[float]:
    """Rank by rank, the median of `key` over the runs."""
    return [statistics.median(values) for values in zip(*(r[key] for r in runs))]


def summarize(runs: list[dict]) -> dict:
    """Medians per case over its runs and the ratios lora / full (per rank for the memory lists)."""
    med = {}
    for case in CASES:
        mine = [r for r in runs if r["case"] == case]
        if not mine:
            raise BenchFailed(f"no {case} runs to summarize")
        med[case] = {"runs": len(mine), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                     "tokens_per_s_range": [min(r["tokens_per_s"] for r in mine), max(r["tokens_per_s"] for r in mine)],
                     **{k: per_rank_median(mine, k) for k in ("params_per_rank", "trainable_params_per_rank",
                                                               "model_state_mib_per_rank", "peak_rss_mib_per_rank")}}
    lora, full = med["lora"], med["full"]
    pairs = {r["repeat"]: r["tokens_per_s"] for r in runs if r["case"] == "full"}  # run n of each: side by side
    ratios = {"tokens_per_s": lora["tokens_per_s"] / full["tokens_per_s"],
              "tokens_per_s_paired": statistics.median(r["tokens_per_s"] / pairs[r["repeat"]] for r in runs
                                                       if r["case"] == "lora" and r["repeat"] in pairs),
              **{k: [a / b for a, b in zip(lora[k], full[k])] for k in ("model_state_mib_per_rank",
                                                                          "peak_rss_mib_per_rank")}}
    check(med)
    return {"medians": med, "ratios": ratios}


def check(med: dict) -> None:
    """The runs did what their names say: full trains every parameter, LoRA a small part of a larger set."""
    lora, full = med["lora"], med["full"]
    if full["trainable_params_per_rank"] != full["params_per_rank"]:
        raise BenchFailed(f"full fine-tuning trained {full['trainable_params_per_rank']} of {full['params_per_rank']} "
                          "parameters per rank, not all")
    for r, (t, p, base) in enumerate(zip(lora["trainable_params_per_rank"], lora["params_per_rank"],
                                         full["params_per_rank"])):
        if not (0 < t < base < p and p - base == t):
            raise BenchFailed(f"LoRA rank {r}: {t:,} trainable of {p:,} parameters (full: {base:,}); expected "
                              f"the base plus adapters, only the adapters training")


def predicted(model: Path, pp: int, procs: int) -> dict:
    """`dstk plan`'s model-state bytes for this layout, LoRA and full (the stage holding the most), or why not."""
    from toolkit.plan.layouts.estimate import Layout
    from toolkit.plan.layouts.planner import PlanRequest, estimate_layout

    if "lora" not in PlanRequest.__dataclass_fields__:
        return {"skipped": "dstk plan has no --lora option"}
    dp = procs // pp
    layout = Layout(pp=pp, dp=dp, zero=0, mbs=MBS, gas=GAS)
    out = {"layout": layout.describe(),
           "command": f"dstk plan --model MODEL_DIR --gpus {procs} --gbs {MBS * GAS * dp} --seq-len {SEQ} --precision "
                      "fp32 --optimizer adam --gpu-mem 1TiB --no-offload --no-checkpointing --top 20 "
                      f"[--lora {LORA_R}]"}
    for case, lora in (("lora", LORA_R), ("full", None)):
        req = PlanRequest(model=str(model), gbs=MBS * GAS * dp, gpus_per_node=procs, gpu_mem=2**40, seq_len=SEQ,
                          precision="fp32", optimizer="adam", lora=lora)
        est = estimate_layout(req, layout)
        out[case] = {"stage": est.stage, "model_state_mib": est.states.peak / 2**20, "parts": list(est.parts)}
    out["ratio"] = out["lora"]["model_state_mib"] / out["full"]["model_state_mib"]
    return out


def markdown(result: dict, meta: dict) -> list[str]:
    """The table under results/lora.md's header (common.write_markdown adds command, machine and date)."""
    med, ratio = result["medians"], result["ratios"]
    mib = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    rat = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [f"Layout pp {meta['pp']}, dp {meta['dp']} ({meta['procs']} CPU processes, one thread each); "
             f"{meta['model']}; fp32, torch AdamW; seq {SEQ}, mbs {MBS} x gas {GAS}; LoRA r {LORA_R} on every "
             f"block linear. Medians of {meta['repeats']} alternating runs (lora, full, ...) of {meta['steps']} "
             f"steps, the first {meta['warmup']} dropped. Per rank: rank 0 / rank 1 / ...", "",
             "| | LoRA | full | LoRA / full |", "|---|---:|---:|---:|",
             f"| tokens/s (median per-step; runs' range) | {_rate(med['lora'])} | {_rate(med['full'])} | "
             f"{ratio['tokens_per_s']:.3f} |",
             "| tokens/s, median of paired ratios (run n LoRA / run n full) | | | "
             f"{ratio['tokens_per_s_paired']:.3f} |",
             f"| model-state MiB per rank | {mib(med['lora']['model_state_mib_per_rank'])} | "
             f"{mib(med['full']['model_state_mib_per_rank'])} | {rat(ratio['model_state_mib_per_rank'])} |",
             f"| peak RSS MiB per rank | {mib(med['lora']['peak_rss_mib_per_rank'])} | "
             f"{mib(med['full']['peak_rss_mib_per_rank'])} | {rat(ratio['peak_rss_mib_per_rank'])} |",
             f"| parameters per rank (trainable) | {_params(med['lora'])} | {_params(med['full'])} | |"]
    lines += ["", *reading(med, ratio)]
    plan = meta.get("plan") or {}
    if "lora" in plan:
        lines += ["", f"`dstk plan` for the same layout ({plan['layout']}; toolkit.plan.layouts.planner.estimate_layout, the "
                  f"pp={meta['pp']} zero=0 row of `{plan['command']}`): model states "
                  f"{plan['lora']['model_state_mib']:.1f} MiB (LoRA) and {plan['full']['model_state_mib']:.1f} MiB "
                  f"(full) on its heaviest stage ({plan['lora']['stage']}), ratio {plan['ratio']:.3f}; measured on "
                  f"that rank: {_at(med, 'lora', plan['lora']['stage'])} and "
                  f"{_at(med, 'full', plan['full']['stage'])} MiB. "
                  "The plan's figure is the peak inside a step (gradients included); the summary's is what the engine "
                  "holds after the last step."]
    else:
        lines += ["", f"`dstk plan` prediction: skipped ({plan.get('skipped', 'not computed')})."]
    loads = meta["load_average_1min"] + meta.get("load_average_runs", [])
    shared = max(loads) > meta["cpus"]
    before, after = meta["load_average_1min"]
    lines += ["", f"Platform: {meta['platform']}. 1-minute load average before/after: {before:.1f} / {after:.1f}, "
              f"highest {max(loads):.1f} (taken before each run), on {meta['cpus']} CPUs"
              + (": other work shared the machine, so tokens/s is noisy (see the runs' range and the paired ratios); "
                 "the memory figures do not depend on load." if shared else ".")
              + " Every run is in bench/results/lora.json."]
    return lines


def reading(med: dict, ratio: dict) -> list[str]:
    """What the numbers mean, from rank 0's figures: model states as multiples of the fp32 base weights."""
    base, adapters = med["full"]["params_per_rank"][0], med["lora"]["trainable_params_per_rank"][0]
    weights = base * 4 / 2**20  # fp32
    lora, full = med["lora"]["model_state_mib_per_rank"][0], med["full"]["model_state_mib_per_rank"][0]
    why = (" (weights and two Adam states: by the end of training, when the summary measures, DeepSpeed has "
           "released the gradients)") if abs(full / weights - 3) < 0.05 else ""
    return [f"Rank 0's model states: LoRA holds its frozen fp32 base ({weights:.1f} MiB) plus {lora - weights:.1f} MiB "
            f"for {adapters:,} adapter parameters ({(lora - weights) * 2**20 / adapters:.1f} bytes each); full "
            f"fine-tuning holds {full / weights:.2f} x the weights{why}. Tokens/s changes far less, by a factor "
            f"{ratio['tokens_per_s']:.2f}: LoRA "
            "skips the base's weight gradients (about a third of a step's FLOPs, so at most ~1.5 x from compute) and "
            "most of the optimizer step, but still runs the forward and the backward through the activations. "
            "Peak RSS includes the processes' torch/DeepSpeed baseline, so it falls less than the model states."]


def _rate(case: dict) -> str:
    low, high = case["tokens_per_s_range"]
    return f"{case['tokens_per_s']:.0f} ({low:.0f}-{high:.0f})"


def _params(case: dict) -> str:
    return " / ".join(f"{p:,} ({t:,})" for p, t in zip(case["params_per_rank"], case["trainable_params_per_rank"]))


def _at(med: dict, case: str, rank: int) -> str:
    states = med[case]["model_state_mib_per_rank"]
    return f"{states[rank]:.1f}" if rank < len(states) else "-"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each case, alternated (default 3)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of tokens/s (default 3)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--procs", type=int, default=2, help="processes; dp = procs / pp (default 2)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed (default 900)")
    p.add_argument("--dry-run", action="store_true", help="print the config and the commands, run nothing")
    args = p.parse_args(argv)
    if args.procs % args.pp or min(args.repeats, args.steps, args.pp, args.procs) < 1 or args.warmup < 0:
        p.error(f"need procs({args.procs}) % pp({args.pp}) == 0, repeats, steps, pp, procs >= 1, warmup >= 0")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dstk-lora-bench-") as tmp:
        work = Path(tmp)
        ctx = {"work": work, "model": work / "model", "config": work / "ds.json", "procs": args.procs,
               "steps": args.steps, "warmup": args.warmup, "timeout": args.timeout}
        ctx["config"].write_text(json.dumps(ds_config(args.pp), indent=1))
        order = [(case, n) for n in range(args.repeats) for case in CASES]
        if args.dry_run:
            print(f"DeepSpeed config: {json.dumps(ds_config(args.pp))}\nmodel: LlamaConfig({MODEL}), vocab 257")
            for case, n in order:
                print(" ".join(train_command(case, args.procs, ctx["config"], ctx["model"], work / f"{case}-{n}",
                                             args.steps)))
            return 0
        return measure_all(args, ctx, order)


def measure_all(args, ctx: dict, order: list) -> int:
    load_before = os.getloadavg()[0]
    params = build_model(ctx["model"])
    meta = {"model": f"llama-style, {params / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} x hidden "
                     f"{MODEL['hidden_size']}, random weights), byte tokenizer",
            "pp": args.pp, "dp": args.procs // args.pp, "procs": args.procs, "repeats": args.repeats,
            "steps": args.steps, "warmup": args.warmup, "cpus": os.cpu_count(), "platform": platform.platform(),
            "seq_len": SEQ, "mbs": MBS,
            "gas": GAS, "lora_r": LORA_R, "ds_config": ds_config(args.pp), "model_config": MODEL}
    runs = []
    try:
        meta["plan"] = predicted(ctx["model"], args.pp, args.procs)
        for case, n in order:
            print(f"{case} run {n + 1}/{args.repeats} ...", flush=True)
            load = os.getloadavg()[0]
            runs.append({**run_one(case, n, ctx), "load_average_1min": load})
            print(f"  {runs[-1]['tokens_per_s']:.0f} tokens/s, model states {runs[-1]['model_state_mib_per_rank']} "
                  f"MiB per rank, {runs[-1]['wall_s']} s", flush=True)
        result = summarize(runs)
    except BenchFailed as exc:
        meta["load_average_1min"] = [load_before, os.getloadavg()[0]]
        return failed(str(exc), meta, runs)
    meta["load_average_1min"] = [load_before, os.getloadavg()[0]]
    meta["load_average_runs"] = [r["load_average_1min"] for r in runs]  # before each run
    common.write_result("lora", {"status": "ok", "meta": meta, **result, "runs": runs})
    lines = markdown(result, meta)
    common.write_markdown("lora", "LoRA vs full fine-tuning (`bench/lora_vs_full.py`)", lines)
    print("\n".join(lines))
    return 0


def failed(why: str, meta: dict, runs: list) -> int:
    """Record and print the failure; no table (the finished runs stay in the JSON, marked failed)."""
    common.write_result("lora", {"status": "failed", "error": why, "meta": meta, "runs": runs})
    common.write_markdown("lora", "LoRA vs full fine-tuning (`bench/lora_vs_full.py`)",
                          ["**FAILED**: no figures from this run.", "", "```", why.strip()[-3000:], "```"])
    print(f"FAILED: {why}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
