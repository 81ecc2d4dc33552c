"""The data layer before and after issue 13 on one synthetic JSONL: time to first step, peak RSS per rank and
tokenization tokens/s, side by side from one run that alternates them (old, new cold, new warm, old, ...).

    .venv/bin/python bench/data_pipeline.py --mb 200 --repeats 1   # the issue's size: ~25 min on 2 CPUs, ~20 GB RAM
    .venv/bin/python bench/data_pipeline.py --quick                # 20 MB, 3 repeats: ~10 min (tests, run_all)
    .venv/bin/python bench/data_pipeline.py --quick --dry-run      # print the commands, run nothing
    .venv/bin/python bench/data_pipeline.py --throughput --mb 200 --chat-mb 50   # cold prepare vs the raw tokenizer
                                                                   # (bench/data_throughput.py says how)

Data: --mb MB (10^6 bytes) of JSON lines {"text": ...}, generated into a temporary folder from --seed
(documents of lognormal length, ~185 words on average, drawn from a fixed vocabulary with a few non-ASCII
words); never kept. With the byte tokenizer a document is its UTF-8 bytes + 1 end-of-text token, so the
generator knows the dataset's token count exactly.

Variants: "old" is the reader of commit OLD_COMMIT (before the rewrite: every rank reads the whole file and
tokenizes it document by document), extracted with `git archive` into the temporary folder and run from there
(PYTHONPATH and working directory); "new" is this tree's toolkit.data (HF datasets, Arrow cache built by
each node's local rank 0, memory-mapped rows), first on an empty --data-cache ("cold"), then again on the
cache the cold run built ("warm"). Per repeat, in this order:

  1. In-process tokenization, one fresh process per variant: old `tokenize(read_records(...))` (+ `split`)
     vs new `data.prepare(...)` on an empty cache (its JSON -> Arrow load timed apart), then prepare again
     (warm). tokens/s = the dataset's tokens / seconds of the stage.
  2. A real 2-rank `dstk train` through launch.sh for each case (old, new cold, new warm): CPU processes,
     one thread each, --model tiny-gpt2, byte tokenizer, seq 128, --steps 2, --eval-fraction 0, --no-export.
     Time to first step: wall seconds from starting launch.sh until metrics.jsonl holds step 1's line.
     Peak RSS per rank: the run's summary (ru_maxrss of each rank). Beside it the peak of the summed RSS
     of every process of the run (launcher, ranks, datasets' tokenizing workers), sampled every 0.2 s.

Reported: medians over --repeats and ratios new / old. A failed run or measurement is reported as failed
(the others still run; exit status 1). Writes bench/results/data_pipeline.json (every run) and .md.
"""

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OLD_COMMIT = "fc94b8f"  # the last commit before the data layer's rewrite
SEQ, STEPS, MODEL = 128, 2, "tiny-gpt2"
CASES = ("old", "new-cold", "new-warm")  # one launch each per repeat, in this order
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def vocabulary(rng: random.Random) -> list[str]:
    """5,000 made-up words of 1-4 syllables, plus a few non-ASCII ones (multi-byte UTF-8)."""
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "da", "vi", "qu", "ne", "pha", "or", "el", "zu", "tim", "bra"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(5000)]
    return words + ["café", "naïve", "über", "日本", "—"]


def generate(path: Path, mb: float, seed: int = 0) -> dict:
    """Write JSON lines {"text": ...} until the file holds mb * 10^6 bytes; its size, documents and tokens
    (byte tokenizer: UTF-8 bytes + 1 end-of-text per document). Same mb and seed: the same bytes."""
    rng = random.Random(seed)
    words = vocabulary(rng)
    size = documents = text_bytes = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            text = " ".join(rng.choices(words, k=int(rng.lognormvariate(4.5, 1.2)) + 1))  # median 90 words
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            size, documents, text_bytes = size + len(line.encode()), documents + 1, text_bytes + len(text.encode())
    return {"bytes": size, "documents": documents, "tokens": text_bytes + documents, "seed": seed}


def old_tree(work: Path) -> Path:
    """toolkit/, setup.cfg and launch.sh of OLD_COMMIT under work/old (git archive: the checkout is untouched)."""
    dest = work / "old"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD_COMMIT, "toolkit", "setup.cfg", "launch.sh"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def child_env(tree: Path, hf_cache: Path) -> dict:
    """This environment less rank variables: `tree`'s toolkit first, one thread per process, datasets' cache."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(hf_cache))
    return env


def ds_config() -> dict:
    """dp 2 (pp 1, ZeRO 0), mbs 2 x gas 1, fp32, torch's AdamW; DeepSpeed's step prints off."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "pipeline": {"stages": 1}, "steps_per_print": 10**6}


def train_command(case: str, tree: Path, config: Path, data: Path, out: Path, cache: Path) -> list[str]:
    """launch.sh (of the variant's tree) ... -- <dstk train args>; the new reader gets its own --data-cache."""
    cmd = ["bash", str(tree / "launch.sh"), "--num-gpus", "2", "--config", str(config), "--", "--model", MODEL,
           "--data", str(data), "--seq-len", str(SEQ), "--steps", str(STEPS), "--eval-fraction", "0",
           "--no-export", "--no-progress", "--out", str(out)]
    return cmd + ([] if case == "old" else ["--data-cache", str(cache)])


class TreeRss:
    """Peak of the summed RSS (MiB) of a process and all its descendants, sampled every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every, self.peak, self._stop = pid, every, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        while not self._stop.wait(self.every):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total / 2**20)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak, 1)


def first_step_seen(metrics: Path) -> bool:
    if not metrics.exists():
        return False
    return any('"step"' in line for line in metrics.read_text().splitlines())


def launch(cmd: list[str], cwd: Path, env: dict, out: Path, log: Path, timeout: float) -> dict:
    """Run one training launch; exit code (None: killed at timeout), wall and first-step seconds, sampled RSS."""
    start = time.perf_counter()
    first, timed_out = None, False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        rss = TreeRss(proc.pid)
        while proc.poll() is None and time.perf_counter() - start < timeout:
            if first is None and first_step_seen(out / "metrics.jsonl"):
                first = time.perf_counter() - start
            time.sleep(0.1)
        if proc.poll() is None:
            timed_out = True
            os.killpg(proc.pid, 15)  # the launcher forwards it to the ranks
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        peak = rss.stop()
    if first is None and first_step_seen(out / "metrics.jsonl"):  # the run ended between two polls
        first = time.perf_counter() - start
    return {"rc": None if timed_out else proc.returncode, "wall_s": round(time.perf_counter() - start, 2),
            "first_step_s": first and round(first, 2),
            "tree_peak_rss_mib": peak}


def run_train(case: str, n: int, ctx: dict) -> dict:
    """One launch of `case`; its figures, or status "failed" with the reason and the log's tail."""
    tree = ctx["old"] if case == "old" else REPO
    cache = ctx["work"] / f"cache-{n}"  # new-warm reuses new-cold's cache of the same repeat
    out, log = ctx["work"] / f"{case}-{n}", ctx["work"] / f"{case}-{n}.log"
    cmd = train_command(case, tree, ctx["config"], ctx["data"], out, cache)
    env = child_env(tree, (ctx["work"] / "hf-old") if case == "old" else cache / "hf")
    got = launch(cmd, tree, env, out, log, ctx["timeout"])
    summary = read_summary(out / "metrics.jsonl")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    entry = {"case": case, "repeat": n, **got, "peak_rss_mib_per_rank": (summary or {}).get("peak_rss_mib_per_rank")}
    if got["rc"] != 0 or summary is None or got["first_step_s"] is None:
        why = (f"timed out after {ctx['timeout']:.0f} s" if got["rc"] is None else f"exit code {got['rc']}"
               if got["rc"] else "no summary or no step line in metrics.jsonl")
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        return {**entry, "status": "failed", "reason": why, "command": cmd, "log_tail": tail}
    return {**entry, "status": "ok"}


def read_summary(path: Path) -> dict | None:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    summaries = [r["summary"] for r in lines if "summary" in r]
    return summaries[-1] if summaries else None


def run_tokenize(variant: str, n: int, ctx: dict) -> dict:
    """The in-process measurement (measure_old / measure_new) in a fresh process of the variant's tree."""
    tree = ctx["old"] if variant == "old" else REPO
    cache = ctx["work"] / f"tok-cache-{variant}-{n}"
    cmd = [sys.executable, str(BENCH / "data_pipeline.py"), "--measure", variant, "--data", str(ctx["data"]),
           "--cache", str(cache)]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=child_env(tree, cache / "hf"), capture_output=True, text=True,
                              timeout=ctx["timeout"])
    except subprocess.TimeoutExpired:
        return {"variant": variant, "repeat": n, "status": "failed", "reason": f"timed out after {ctx['timeout']} s"}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        return {"variant": variant, "repeat": n, "status": "failed", "reason": f"exit code {proc.returncode}",
                "log_tail": "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    tokens = ctx["gen"]["tokens"]
    rates = {k.replace("_s", "_tokens_per_s"): tokens / got[k] for k in ("tokenize_s", "total_s", "warm_s") if k in got}
    return {"variant": variant, "repeat": n, "status": "ok", **got, **rates}


def measure_old(data: str) -> dict:
    """Old reader, timed by stage: read_records, tokenize (document by document, packed into a tensor), split."""
    t0 = time.perf_counter()
    from toolkit.train import data as old  # the old tree's layout (OLD_COMMIT), before the package map
    from toolkit.train import hf

    tok = hf.byte_tokenizer()
    t1 = time.perf_counter()
    records = old.read_records(data)
    t2 = time.perf_counter()
    tokens = old.tokenize(records, tok, SEQ)
    t3 = time.perf_counter()
    old.split(tokens, 0.0, 1234)
    t4 = time.perf_counter()
    return {"module": old.__file__, "import_s": t1 - t0, "read_s": t2 - t1, "tokenize_s": t3 - t2,
            "split_s": t4 - t3, "total_s": t4 - t1, "rows": len(tokens), "workers": 1}


def measure_new(data: str, cache: str) -> dict:
    """New reader on an empty cache: JSON -> Arrow (load), then prepare (tokenize, split, pack); then warm."""
    t0 = time.perf_counter()
    import datasets

    from toolkit import data as new

    from toolkit.train import hf
    from toolkit.data.source import load

    datasets.disable_progress_bars()
    tok = hf.byte_tokenizer()
    opts = new.DataOptions(path=data, seq_len=SEQ, eval_fraction=0.0, cache_dir=cache)
    t1 = time.perf_counter()
    docs = len(load(data, cache_dir=cache))
    t2 = time.perf_counter()
    prepared = new.prepare(opts, tok)
    t3 = time.perf_counter()
    new.prepare(opts, tok)
    t4 = time.perf_counter()
    return {"module": new.__file__, "import_s": t1 - t0, "read_s": t2 - t1, "tokenize_s": t3 - t2, "total_s": t3 - t1,
            "warm_s": t4 - t3, "rows": len(prepared.train), "documents": docs,
            "workers": 1 if docs < 20_000 else min(8, os.cpu_count() or 1)}


def measure_child(args) -> int:
    got = measure_old(args.data) if args.measure == "old" else measure_new(args.data, args.cache)
    got["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    got["children_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}))
    return 0


def median_or_none(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], toks: list[dict]) -> dict:
    """Per case: runs ok / total, medians (per rank for RSS) over the ok runs; ratios to the old reader."""
    out = {}
    for case in CASES:
        mine = [r for r in runs if r["case"] == case]
        ok = [r for r in mine if r["status"] == "ok"]
        ranks = [r["peak_rss_mib_per_rank"] for r in ok if r["peak_rss_mib_per_rank"]]
        out[case] = {"runs": len(mine), "ok": len(ok),
                     "first_step_s": median_or_none([r["first_step_s"] for r in ok]),
                     "first_step_range": [min(r["first_step_s"] for r in ok), max(r["first_step_s"] for r in ok)]
                     if ok else None,
                     "peak_rss_mib_per_rank": [statistics.median(v) for v in zip(*ranks)] if ranks else None,
                     "tree_peak_rss_mib": median_or_none([r["tree_peak_rss_mib"] for r in ok])}
    for variant, key, case in (("old", "tokenize_tokens_per_s", "old"), ("new", "tokenize_tokens_per_s", "new-cold"),
                               ("new", "warm_tokens_per_s", "new-warm")):
        mine = [t for t in toks if t["variant"] == variant]
        ok = [t for t in mine if t["status"] == "ok"]
        out[case].update(tokenize_runs=len(mine), tokenize_ok=len(ok),
                         tokenize_tokens_per_s=median_or_none([t.get(key) for t in ok]),
                         total_tokens_per_s=median_or_none([t.get("total_tokens_per_s") for t in ok])
                         if case != "new-warm" else None,
                         tokenize_peak_rss_mib=median_or_none([t.get("peak_rss_mib") for t in ok]))
    return {"medians": out, "ratios": {case: ratios(out[case], out["old"]) for case in CASES[1:]}}


def ratios(case: dict, old: dict) -> dict:
    div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    per_rank = (None if not (case["peak_rss_mib_per_rank"] and old["peak_rss_mib_per_rank"]) else
                [a / b for a, b in zip(case["peak_rss_mib_per_rank"], old["peak_rss_mib_per_rank"])])
    return {"first_step_s": div(case["first_step_s"], old["first_step_s"]), "peak_rss_mib_per_rank": per_rank,
            "tree_peak_rss_mib": div(case["tree_peak_rss_mib"], old["tree_peak_rss_mib"]),
            "tokenize_tokens_per_s": div(case["tokenize_tokens_per_s"], old["tokenize_tokens_per_s"]),
            "total_tokens_per_s": div(case["total_tokens_per_s"], old["total_tokens_per_s"])}


def cell(value, fmt: str, ok: int = 1, total: int = 1) -> str:
    """A number, or "failed" when no run of the case succeeded; "(k of n ok)" when some failed."""
    if value is None:
        return "failed" if total and not ok else "-"
    text = " / ".join(format(v, fmt) for v in value) if isinstance(value, list) else format(value, fmt)
    return text + ("" if ok == total else f" ({ok} of {total} ok)")


def table(result: dict) -> list[str]:
    """The side-by-side table: old, new cold, new warm, and the two ratios to old."""
    med, rat = result["medians"], result["ratios"]
    rows = [("time to first step (s)", "first_step_s", ".1f", ".3f", "runs"),
            ("peak RSS MiB per rank (rank 0 / rank 1)", "peak_rss_mib_per_rank", ".0f", ".3f", "runs"),
            ("peak RSS MiB, all processes of the run (sampled)", "tree_peak_rss_mib", ".0f", ".3f", "runs"),
            ("tokenization tokens/s (in-process)", "tokenize_tokens_per_s", ",.0f", ".3f", "tokenize_runs"),
            ("file -> rows tokens/s (in-process, read included)", "total_tokens_per_s", ",.0f", ".3f",
             "tokenize_runs")]
    lines = ["| | old reader | new, cold cache | new, warm cache | new cold / old | new warm / old |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, key, fmt, rfmt, count in rows:
        ok = "ok" if count == "runs" else "tokenize_ok"
        cells = [cell(med[c][key], fmt, med[c][ok], med[c][count]) for c in CASES]
        cells += [cell(rat[c][key], rfmt) if rat[c][key] is not None else "-" for c in CASES[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict, meta: dict, runs: list, toks: list) -> list[str]:
    gen = meta["data"]
    lines = [f"Data: {gen['bytes'] / 1e6:.1f} MB of synthetic JSON lines (`--mb {meta['mb']:g}`, seed {gen['seed']}): "
             f"{gen['documents']:,} documents, {gen['tokens']:,} tokens with the byte tokenizer. Old reader: commit "
             f"{OLD_COMMIT} (`git archive`); new: this tree. Each run: 2 CPU processes (dp 2) through launch.sh, one "
             f"thread each, {MODEL}, seq {SEQ}, {STEPS} steps, --eval-fraction 0. Medians of {meta['repeats']} "
             "repeat(s), each running old, new on an empty cache, new on that cache, in turn. RAM "
             f"{meta['ram_gib']:.1f} GiB.", "", *table(result), ""]
    lines += notes(result, meta)
    failed = [r for r in runs + toks if r["status"] != "ok"]
    for r in failed:
        lines += ["", f"**FAILED**: {r.get('case', r.get('variant'))} {'run' if 'case' in r else 'tokenization'} "
                  f"{r['repeat'] + 1}: {r['reason']}" + (f"\n\n```\n{r['log_tail'][-1500:]}\n```" if r.get("log_tail")
                                                          else "")]
    return lines


def notes(result: dict, meta: dict) -> list[str]:
    med = result["medians"]
    workers = meta.get("new_workers")
    before, after = meta["load_average_1min"]
    return [f"Time to first step: from starting launch.sh (its pre-check process included) until metrics.jsonl "
            "holds step 1. Peak RSS per rank: ru_maxrss from the run's summary (the memory-mapped Arrow pages a rank "
            "touched count in it); the all-processes figure adds the launcher and the tokenizing worker processes "
            "(new cold: local rank 0 tokenizes with "
            f"{workers if workers else '?'} worker process(es) for this file). In-process tokenization: one fresh "
            "process per variant, tokens of the whole file / seconds of old `tokenize` (document by document, "
            "packed into a tensor) vs new `prepare` after its JSON -> Arrow load (tokenize, split, pack, written "
            "to the cache); the warm column is a second `prepare` on that cache. In-process peak RSS: old "
            f"{cell(med['old']['tokenize_peak_rss_mib'], '.0f')} MiB, new "
            f"{cell(med['new-cold']['tokenize_peak_rss_mib'], '.0f')} MiB (the process itself, workers not counted).",
            "", f"Platform: {meta['platform']}. 1-minute load average before/after: {before:.1f} / {after:.1f} on "
            f"{meta['cpus']} CPUs. Every run and measurement is in bench/results/data_pipeline.json."]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=200, help="size of the generated JSONL in MB (default 200)")
    p.add_argument("--quick", action="store_true", help="--mb 20 (tests, run_all --quick)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of old, new cold, new warm (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed (default 1800)")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (logs, data), not a temporary folder")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--throughput", action="store_true",
                   help="cold-cache preparation against the raw tokenizer instead (bench/data_throughput.py)")
    p.add_argument("--chat-mb", type=float, default=50, help="--throughput: MB of chat rows (default 50)")
    p.add_argument("--no-record", action="store_true", help="--throughput: write nothing to bench/results (tests)")
    p.add_argument("--measure", choices=("old", "new"), help=argparse.SUPPRESS)  # the in-process child
    p.add_argument("--measure-throughput", choices=("raw", "dstk"), help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=("text", "chat"), help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.mb = 20
    if args.repeats < 1 or args.mb <= 0:
        p.error(f"need --repeats >= 1 and --mb > 0, got {args.repeats} and {args.mb}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.measure:
        return measure_child(args)
    if args.measure_throughput or args.throughput:
        sys.path.insert(0, str(BENCH))
        import data_throughput

        args.measure = args.measure_throughput
        return data_throughput.measure_child(args) if args.measure else data_throughput.main(args)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        return bench(args, Path(args.keep))
    with tempfile.TemporaryDirectory(prefix="dstk-data-bench-") as tmp:
        return bench(args, Path(tmp))


def bench(args, work: Path) -> int:
    ctx = {"work": work, "data": work / "data.jsonl", "config": work / "ds.json", "timeout": args.timeout,
           "old": work / "old"}
    if args.dry_run:
        for n in range(args.repeats):
            for case in CASES:
                tree = ctx["old"] if case == "old" else REPO
                cmd = train_command(case, tree, ctx["config"], ctx["data"], work / f"{case}-{n}", work / f"cache-{n}")
                print(f"[{case} {n + 1}] cd {tree} && " + " ".join(cmd))
        return 0
    ctx["config"].write_text(json.dumps(ds_config(), indent=1))
    ctx["old"] = old_tree(work)
    load_before = os.getloadavg()[0]
    print(f"generating {args.mb} MB ...", flush=True)
    ctx["gen"] = generate(ctx["data"], args.mb, args.seed)
    runs, toks = [], []
    for n in range(args.repeats):
        for variant in ("old", "new"):
            print(f"tokenize {variant} {n + 1}/{args.repeats} ...", flush=True)
            toks.append(run_tokenize(variant, n, ctx))
            print(f"  {toks[-1]}", flush=True)
        for case in CASES:
            print(f"train {case} {n + 1}/{args.repeats} ...", flush=True)
            runs.append(run_train(case, n, ctx))
            print(f"  {({k: v for k, v in runs[-1].items() if k not in ('log_tail', 'command')})}", flush=True)
        shutil.rmtree(work / f"cache-{n}", ignore_errors=True)
    return report(args, ctx, runs, toks, load_before)


def report(args, ctx: dict, runs: list, toks: list, load_before: float) -> int:
    sys.path[:0] = [str(REPO), str(BENCH)]
    import common
    from importlib import metadata

    result = summarize(runs, toks)
    new_ok = [t for t in toks if t["variant"] == "new" and t["status"] == "ok"]
    meta = {"mb": args.mb, "repeats": args.repeats, "data": ctx["gen"], "old_commit": OLD_COMMIT, "model": MODEL,
            "seq_len": SEQ, "steps": STEPS, "ds_config": ds_config(), "cpus": os.cpu_count(),
            "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "platform": platform.platform(), "load_average_1min": [load_before, os.getloadavg()[0]],
            "new_workers": new_ok[0]["workers"] if new_ok else None,
            "data_versions": {p: _version(metadata, p) for p in ("datasets", "pyarrow", "tokenizers", "psutil")}}
    status = "ok" if all(r["status"] == "ok" for r in runs + toks) else "failed"
    common.write_result("data_pipeline", {"status": status, "meta": meta, **result, "runs": runs, "tokenize": toks})
    lines = markdown(result, meta, runs, toks)
    common.write_markdown("data_pipeline", "Data pipeline: old reader vs datasets (`bench/data_pipeline.py`)", lines)
    print("\n".join(lines))
    return 0 if status == "ok" else 1


def _version(metadata, pkg: str):
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
