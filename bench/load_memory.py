"""Peak RSS per rank of a pp 2 `dstk train` from a bf16 checkpoint under a bf16 config, before and after the
stages load their weights in the run's dtype without initialising what the checkpoint holds (issue 24, item 8).

    .venv/bin/python bench/load_memory.py                       # LoRA, 3 repeats x (old, new): ~4 min, 2 CPUs
    .venv/bin/python bench/load_memory.py --cases lora,full     # and full fine-tuning: ~12 min
    .venv/bin/python bench/load_memory.py --old HEAD~3 --new HEAD   # any two commits (default new: this tree)
    .venv/bin/python bench/load_memory.py --dry-run             # print the config and the commands, run nothing

Model: a Llama-shaped decoder (MODEL below, 155M parameters, random weights from seed 0) saved in bf16 with
save_pretrained (310 MB of safetensors), the byte tokenizer beside it. Each run is `dstk train` through the
variant's launch.sh, as bench/lora_vs_full.py launches it: 2 CPU processes (pp 2, dp 1), one thread each,
bf16.enabled, torch's AdamW, seq 64, mbs 1 x gas 2, 2 steps, the shipped corpus, no eval, no export. Cases:
LoRA (`--lora --lora-r 16`: the frozen base is most of what a rank holds) and full fine-tuning (fp32 masters,
fp32 gradients and Adam's states, 16 bytes per parameter beside the 2 of the bf16 weights, set the peak).
Variants: "old" is OLD_COMMIT's toolkit/, models/ and launch.sh (`git archive` into a temporary folder; the
checkout is untouched), "new" this tree (or --new REV, extracted the same way); each runs from its own tree
(PYTHONPATH and working directory). Per repeat, for each case asked (--cases): old, then new.
Peak RSS per rank: the run's summary (`peak_rss_mib_per_rank`, ru_maxrss of each rank at the end of the run,
so the highest RSS it ever had: loading, training and the final checkpoint). Reported: medians over the
repeats, per rank, and the ratios new / old. A failed run fails the benchmark (exit 1, the log's tail shown).
Writes bench/results/load_memory.json (every run) and bench/results/load_memory.md.
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

OLD_COMMIT = "d59b7dd"  # the last commit before the change: every stage built in fp32 and initialised first
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
SEQ, MBS, GAS, STEPS, LORA_R = 64, 1, 2, 2, 16
# transformers.LlamaConfig fields: 12 blocks of hidden 1024 -> 155M parameters with the byte tokenizer's 257 rows
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=16, max_position_embeddings=256, tie_word_embeddings=False)
CASES = ("lora", "full")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class BenchFailed(RuntimeError):
    """A run failed or measured nothing: the benchmark reports it and exits 1, with no table."""


def save_model(path: Path) -> tuple[int, int]:
    """The random Llama-shaped model in bf16 and the byte tokenizer, saved to `path`; (parameters, bytes saved)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from toolkit.train.hf import byte_tokenizer

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()), sum(f.stat().st_size for f in path.glob("*.safetensors"))


def ds_config() -> dict:
    """pp 2, bf16, torch's AdamW, no clipping; DeepSpeed's step prints off."""
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"stages": 2}, "steps_per_print": 10**6}


def train_command(case: str, tree: Path, config: Path, model: Path, out: Path) -> list[str]:
    """The variant's launch.sh ... -- <dstk train args> for one run of `case` ("lora" or "full")."""
    cmd = ["bash", str(tree / "launch.sh"), "--num-gpus", "2", "--config", str(config), "--",
           "--model", str(model), "--data", str(CORPUS), "--seq-len", str(SEQ), "--steps", str(STEPS),
           "--eval-fraction", "0", "--no-export", "--no-progress", "--out", str(out)]
    return cmd + (["--lora", "--lora-r", str(LORA_R)] if case == "lora" else [])


def child_env(tree: Path) -> dict:
    """This environment less rank variables: `tree`'s code first, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_one(variant: str, case: str, n: int, ctx: dict) -> dict:
    """Launch one run; its figures from the summary, or BenchFailed with the tail of its log."""
    name = f"{variant}-{case}-{n}"
    out, log, tree = ctx["work"] / name, ctx["work"] / f"{name}.log", ctx["trees"][variant]
    cmd = train_command(case, tree, ctx["config"], ctx["model"], out)
    # python -m puts the working directory first on sys.path: the variant's code is the one imported
    rc, wall = common.launch(cmd, log, child_env(tree), ctx["timeout"], cwd=tree)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the trainer saves one at the last step
    if rc != 0:
        why = f"timed out after {ctx['timeout']:.0f} s" if rc is None else f"exit code {rc}"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise BenchFailed(f"{name} failed ({why}): {' '.join(cmd)}\n{tail}")
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    summaries = [json.loads(line)["summary"] for line in lines if '"summary"' in line]
    if not summaries:
        raise BenchFailed(f"{name}: no summary in {out / 'metrics.jsonl'}")
    keys = ("params_per_rank", "trainable_params_per_rank", "model_state_mib_per_rank", "peak_rss_mib_per_rank")
    figures = {k: summaries[-1][k] for k in keys}
    return {"variant": variant, "case": case, "repeat": n, "wall_s": round(wall, 1), **figures}


def summarize(runs: list[dict]) -> dict:
    """Per case and variant, medians per rank over the repeats; per case the ratios new / old."""
    out = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        med = {}
        for variant in ("old", "new"):
            mine = [r for r in runs if r["variant"] == variant and r["case"] == case]
            med[variant] = {"runs": len(mine), "wall_s": statistics.median(r["wall_s"] for r in mine),
                            **{k: [statistics.median(v) for v in zip(*(r[k] for r in mine))]
                               for k in ("peak_rss_mib_per_rank", "model_state_mib_per_rank", "params_per_rank",
                                         "trainable_params_per_rank")}}
        if med["old"]["params_per_rank"] != med["new"]["params_per_rank"]:
            raise BenchFailed(f"{case}: old and new hold different parameters per rank: {med['old']['params_per_rank']}"
                              f" vs {med['new']['params_per_rank']}")
        ratio = [n / o for n, o in zip(med["new"]["peak_rss_mib_per_rank"], med["old"]["peak_rss_mib_per_rank"])]
        out[case] = {**med, "ratio_peak_rss": ratio, "ratio_wall": med["new"]["wall_s"] / med["old"]["wall_s"]}
    return out


def markdown(result: dict, meta: dict) -> list[str]:
    """The table under results/load_memory.md's header (common.write_markdown adds command, machine, date)."""
    mib = lambda xs: " / ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    rat = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [f"Model: {meta['model']}. Layout pp 2, dp 1 (2 CPU processes, one thread each); bf16.enabled, torch "
             f"AdamW; seq {SEQ}, mbs {MBS} x gas {GAS}, {STEPS} steps; LoRA r {LORA_R} on every block linear. Old: "
             f"commit {meta['old']} (`git archive`); new: {meta['new']}. Medians of {meta['repeats']} repeat(s), each "
             "running old then new for each case. Per rank: rank 0 / rank 1.", "",
             "| case | peak RSS MiB, old | peak RSS MiB, new | new / old | run wall s, old / new | "
             "model-state MiB (old = new) |", "|---|---:|---:|---:|---:|---:|"]
    for case in result:
        r, label = result[case], {"lora": "LoRA", "full": "full fine-tuning"}[case]
        lines.append(f"| {label} | {mib(r['old']['peak_rss_mib_per_rank'])} | {mib(r['new']['peak_rss_mib_per_rank'])}"
                     f" | {rat(r['ratio_peak_rss'])} | {r['old']['wall_s']:.0f} / {r['new']['wall_s']:.0f} | "
                     f"{mib(r['new']['model_state_mib_per_rank'])} |")
    new = next(iter(result.values()))["new"]
    base = new["params_per_rank"][0] - (new["trainable_params_per_rank"][0] if "lora" in result else 0)
    lines += ["", f"Rank 0's stage holds {base / 1e6:.0f}M base parameters: {base * 4 / 2**20:.0f} MiB in fp32, "
              f"{base * 2 / 2**20:.0f} MiB in bf16. The old code built every stage in fp32 (drawing a random init for "
              "every matrix) before DeepSpeed cast it to bf16; the new one reads the bf16 tensors into bf16 parameters "
              "and initialises only what the checkpoint lacks. The peak falls by less than the fp32 copy's extra "
              "bytes: an RSS timeline sampled beside such runs showed the old ranks keep the freed fp32 memory in "
              "their heap, where the engine's later allocations reuse it, while the new ones take fresh pages for "
              "them. With LoRA the frozen base is most of what a rank holds; in full fine-tuning the fp32 masters, "
              "gradients and Adam states allocated later set the peak and hide the load's saving. Peak RSS includes "
              "each process's torch/DeepSpeed baseline (about 500 MiB before the model is built)."]
    loads = meta["load_average_1min"]
    lines += ["", f"Platform: {meta['platform']}. 1-minute load average before/after: {loads[0]:.1f} / {loads[1]:.1f} "
              f"on {meta['cpus']} CPUs (the memory figures do not depend on load; wall times do). Every run is in "
              "bench/results/load_memory.json."]
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="repeats of each case's old and new runs (default 3)")
    p.add_argument("--cases", default="lora", help="comma-separated, of: lora, full (default lora)")
    p.add_argument("--old", default=OLD_COMMIT, help=f"commit of the old code (default {OLD_COMMIT})")
    p.add_argument("--new", default=None, help="commit of the new code (default: this tree as it is)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed (default 600)")
    p.add_argument("--dry-run", action="store_true", help="print the config and the commands, run nothing")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.repeats < 1 or not args.cases or set(args.cases) - set(CASES):
        p.error(f"need --repeats >= 1 (got {args.repeats}) and --cases from {', '.join(CASES)} (got {args.cases})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dstk-load-bench-") as tmp:
        work = Path(tmp)
        trees = {"old": work / "old-tree", "new": work / "new-tree" if args.new else REPO}
        ctx = {"work": work, "model": work / "model", "config": work / "ds.json", "trees": trees,
               "timeout": args.timeout}
        ctx["config"].write_text(json.dumps(ds_config(), indent=1))
        order = [(variant, case, n) for n in range(args.repeats) for case in args.cases for variant in ("old", "new")]
        if args.dry_run:
            print(f"DeepSpeed config: {json.dumps(ds_config())}\nmodel: LlamaConfig({MODEL}), vocab 257, bf16")
            for variant, case, n in order:
                print(" ".join(train_command(case, trees[variant], ctx["config"], ctx["model"],
                                             work / f"{variant}-{case}-{n}")))
            return 0
        common.extract(args.old, trees["old"])
        if args.new:
            common.extract(args.new, trees["new"])
        return measure_all(args, ctx, order)


def measure_all(args, ctx: dict, order: list) -> int:
    load_before = os.getloadavg()[0]
    params, size = save_model(ctx["model"])
    meta = {"model": f"Llama-shaped, {params / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} x hidden "
                     f"{MODEL['hidden_size']}, random weights) saved in bf16 ({size / 1e6:.0f} MB), byte tokenizer",
            "old": args.old, "new": args.new or "this tree", "repeats": args.repeats, "cpus": os.cpu_count(),
            "platform": platform.platform(), "ds_config": ds_config(), "model_config": MODEL}
    runs = []
    try:
        for variant, case, n in order:
            print(f"{variant} {case} run {n + 1}/{args.repeats} ...", flush=True)
            runs.append(run_one(variant, case, n, ctx))
            print(f"  peak RSS {runs[-1]['peak_rss_mib_per_rank']} MiB per rank, {runs[-1]['wall_s']} s", flush=True)
        result = summarize(runs)
    except BenchFailed as exc:
        meta["load_average_1min"] = [load_before, os.getloadavg()[0]]
        common.write_result("load_memory", {"status": "failed", "error": str(exc), "meta": meta, "runs": runs})
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    meta["load_average_1min"] = [load_before, os.getloadavg()[0]]
    common.write_result("load_memory", {"status": "ok", "meta": meta, "medians": result, "runs": runs})
    lines = markdown(result, meta)
    title = "Loading a bf16 checkpoint at pp 2: peak RSS per rank (`bench/load_memory.py`)"
    common.write_markdown("load_memory", title, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
