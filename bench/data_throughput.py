"""Cold-cache data preparation against the raw tokenizer on the same text (`data_pipeline.py --throughput`).

    .venv/bin/python bench/data_pipeline.py --throughput --mb 200 --chat-mb 50 --repeats 3   # the issue's size
    .venv/bin/python bench/data_pipeline.py --throughput --mb 2 --chat-mb 1 --repeats 1     # a quick look

Data: --mb MB of JSON lines {"text": ...} (data_pipeline.generate) and --chat-mb MB of chat rows {"messages":
[system?, (user, assistant) x 1-3]} from the same made-up vocabulary. Tokenizer: a byte-level BPE of 32,000
tokens trained here with the `tokenizers` library on the first 20,000 documents (as a user's own tokenizer
would be), wrapped in transformers' PreTrainedTokenizerFast with a ChatML template.

Per repeat and kind (text, chat), alternating, each in a fresh process with the tokenizer's own threads on:
  raw    the texts already in memory (the chat rows rendered with the template beforehand, untimed), then
         timed: backend.encode_batch_fast over batches of 2,000 (the fast tokenizer's own batching and threads),
         the ids taken out of each batch (Encoding.ids: what any caller of the tokenizer gets)
  dstk   toolkit.data.prepare on an empty --data-cache with --data-workers = the cores, timed whole: JSON ->
         Arrow, tokenizing, the eval split (5%), packing to seq 2048 and writing the cache; then again on
         that cache (warm)
Throughput = the raw tokenizer's token count / seconds; ratio = dstk / raw (medians of the repeats).
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SEQ, VOCAB, TRAIN_DOCS, BATCH = 2048, 32_000, 20_000, 2_000
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KINDS = ("text", "chat")


def generate_chat(path: Path, mb: float, seed: int = 0) -> dict:
    """Chat rows until the file holds mb * 10^6 bytes; its size and row count. Same mb and seed: same bytes."""
    sys.path.insert(0, str(BENCH))
    from data_pipeline import vocabulary

    rng = random.Random(seed)
    words = vocabulary(rng)
    size = rows = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                for role, mu in (("user", 3.0), ("assistant", 4.2)):
                    words_n = int(rng.lognormvariate(mu, 1.0)) + 1
                    messages.append({"role": role, "content": " ".join(rng.choices(words, k=words_n))})
            line = json.dumps({"messages": messages}, ensure_ascii=False) + "\n"
            f.write(line)
            size, rows = size + len(line.encode()), rows + 1
    return {"bytes": size, "rows": rows, "seed": seed}


def train_tokenizer(corpus: Path, out: Path) -> Path:
    """A byte-level BPE trained on the corpus's first TRAIN_DOCS documents, saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        with open(corpus, encoding="utf-8") as f:
            for n, line in zip(range(TRAIN_DOCS), f):
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return out


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure_raw(kind: str, data: str, tokenizer: str) -> dict:
    """The fast tokenizer alone on the texts (in memory): encode_batch_fast over batches of BATCH."""
    import pyarrow.json as pj
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    table = pj.read_json(data)
    if kind == "text":
        texts = table.column("text").to_pylist()
    else:
        texts = [tok.apply_chat_template(m, tokenize=False) for m in table.column("messages").to_pylist()]
    engine = tok.backend_tokenizer
    start, cpu, tokens = time.perf_counter(), cpu_seconds(), 0
    for i in range(0, len(texts), BATCH):
        ids = [e.ids for e in engine.encode_batch_fast(texts[i: i + BATCH], add_special_tokens=False)]
        tokens += sum(map(len, ids))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu, "tokens": tokens,
            "documents": len(texts)}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) and its waited-for children."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def measure_dstk(data: str, tokenizer: str, cache: str) -> dict:
    """toolkit.data.prepare on an empty cache (timed whole), then on that cache (warm)."""
    import datasets
    from transformers import AutoTokenizer

    from toolkit import data as dstk

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    opts = dstk.DataOptions(path=data, seq_len=SEQ, cache_dir=cache, workers=cores())
    start, cpu = time.perf_counter(), cpu_seconds()
    prepared = dstk.prepare(opts, tok, quiet=True)
    cold, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    dstk.prepare(opts, tok, quiet=True)
    return {"seconds": cold, "cpu_seconds": cpu, "warm_seconds": time.perf_counter() - start - cold,
            "rows": len(prepared.train),
            "format": prepared.info["format"], "workers": cores()}


def measure_child(args) -> int:
    got = (measure_raw(args.kind, args.data, args.tokenizer) if args.measure == "raw"
           else measure_dstk(args.data, args.tokenizer, args.cache))
    print(json.dumps(got))
    return 0


def run_one(side: str, kind: str, n: int, ctx: dict) -> dict:
    """One measurement in a fresh process; its figures, or status "failed" with the reason."""
    cache = ctx["work"] / f"cache-{kind}-{n}"
    cmd = [sys.executable, str(BENCH / "data_pipeline.py"), "--measure-throughput", side, "--kind", kind,
           "--data", str(ctx["data"][kind]), "--tokenizer", str(ctx["tokenizer"]), "--cache", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true",
           "HF_DATASETS_CACHE": str(cache / "hf")}
    entry = {"side": side, "kind": kind, "repeat": n}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx["timeout"])
    except subprocess.TimeoutExpired:
        return {**entry, "status": "failed", "reason": f"timed out after {ctx['timeout']:.0f} s"}
    finally:
        subprocess.run(["rm", "-rf", str(cache)], check=False)
    if proc.returncode != 0:
        return {**entry, "status": "failed", "reason": f"exit code {proc.returncode}",
                "log_tail": "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])}
    return {**entry, "status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


def summarize(results: list[dict]) -> dict:
    """Per kind: medians of the ok runs (seconds, tokens/s on the raw token count), ratio dstk / raw."""
    out = {}
    for kind in KINDS:
        mine = [r for r in results if r["kind"] == kind]
        raw = [r for r in mine if r["side"] == "raw" and r["status"] == "ok"]
        tokens = raw[0]["tokens"] if raw else None
        row = {"tokens": tokens, "documents": raw[0]["documents"] if raw else None}
        for side in ("raw", "dstk"):
            ok = [r for r in mine if r["side"] == side and r["status"] == "ok"]
            row[side] = {"runs": sum(r["side"] == side for r in mine), "ok": len(ok),
                         "seconds": statistics.median(r["seconds"] for r in ok) if ok else None,
                         "cpu_seconds": statistics.median(r["cpu_seconds"] for r in ok) if ok else None,
                         "all_seconds": [round(r["seconds"], 2) for r in ok]}
            row[side]["tokens_per_s"] = tokens / row[side]["seconds"] if ok and tokens else None
        warm = [r["warm_seconds"] for r in mine if r["side"] == "dstk" and r["status"] == "ok"]
        row["dstk"]["warm_seconds"] = statistics.median(warm) if warm else None
        both = row["raw"]["seconds"] and row["dstk"]["seconds"]
        row["ratio"] = row["raw"]["seconds"] / row["dstk"]["seconds"] if both else None
        row["cpu_ratio"] = row["raw"]["cpu_seconds"] / row["dstk"]["cpu_seconds"] if both else None
        out[kind] = row
    return out


def table(summary: dict) -> list[str]:
    lines = ["| data | tokens | raw tokenizer tokens/s | dstk cold prepare tokens/s | dstk / raw | raw s (runs) | "
             "dstk s (runs) | dstk / raw, CPU seconds | dstk warm s |", "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for kind, row in summary.items():
        def rate(side):
            got = row[side]
            return "failed" if not got["ok"] else f"{got['tokens_per_s']:,.0f}" + (
                "" if got["ok"] == got["runs"] else f" ({got['ok']} of {got['runs']} ok)")
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        warm = "-" if row["dstk"]["warm_seconds"] is None else f"{row['dstk']['warm_seconds']:.1f}"
        cpu = "-" if row["cpu_ratio"] is None else f"{row['cpu_ratio']:.3f}"
        lines.append(f"| {kind} | {row['tokens'] or 0:,} | {rate('raw')} | {rate('dstk')} | {ratio} | "
                     f"{row['raw']['all_seconds']} | {row['dstk']['all_seconds']} | {cpu} | {warm} |")
    return lines


def main(args) -> int:
    import tempfile

    sys.path[:0] = [str(REPO), str(BENCH)]
    import common
    from data_pipeline import generate

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dstk-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    gen = {"text": generate(work / "text.jsonl", args.mb), "chat": generate_chat(work / "chat.jsonl", args.chat_mb)}
    ctx = {"work": work, "timeout": args.timeout, "data": {k: work / f"{k}.jsonl" for k in KINDS},
           "tokenizer": train_tokenizer(work / "text.jsonl", work / "tokenizer")}
    results = []
    for n in range(args.repeats):
        for kind in KINDS:
            for side in ("raw", "dstk"):
                results.append(run_one(side, kind, n, ctx))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "log_tail"}), flush=True)
    summary = summarize(results)
    meta = {"mb": args.mb, "chat_mb": args.chat_mb, "repeats": args.repeats, "data": gen, "cores": cores(),
            "seq_len": SEQ, "vocab": VOCAB, "platform": common.machine()["platform"],
            "load_average_1min": [load_before, os.getloadavg()[0]]}
    status = "ok" if all(r["status"] == "ok" for r in results) else "failed"
    lines = markdown(summary, meta, results)
    if not args.no_record:
        common.write_result("data_throughput", {"status": status, "meta": meta, "summary": summary, "runs": results})
        common.write_markdown("data_throughput", "Data preparation vs the raw tokenizer (`bench/data_pipeline.py "
                              "--throughput`)", lines)
    print("\n".join(lines))
    return 0 if status == "ok" else 1


def markdown(summary: dict, meta: dict, results: list[dict]) -> list[str]:
    text, chat = meta["data"]["text"], meta["data"]["chat"]
    lines = [f"Data: {text['bytes'] / 1e6:.1f} MB of synthetic text JSON lines ({text['documents']:,} documents) "
             f"and {chat['bytes'] / 1e6:.1f} MB of chat rows ({chat['rows']:,} conversations); a byte-level BPE of "
             f"{meta['vocab']:,} tokens trained here with `tokenizers`; seq {meta['seq_len']}, 5% eval split, "
             f"--data-workers {meta['cores']} (the cores). Medians of {meta['repeats']} repeat(s), raw and dstk "
             "alternating, each a fresh process.", "", *table(summary), "",
             "raw: `encode_batch_fast` of the fast tokenizer over batches of 2,000 texts already in memory (chat: "
             "rendered with the template beforehand, untimed), its own threads on, the ids taken out (`.ids`). dstk: `toolkit.data.prepare` on "
             "an empty cache, timed whole (JSON -> Arrow, chat template rendering, tokenizing, eval split, "
             "packing, cache writes); tokens/s of both on the raw token count. dstk / raw = throughput ratio = raw seconds / dstk "
             "seconds (wall); beside it the same ratio of CPU seconds (user + system, all threads and worker "
             "processes), which the other loads of a shared machine disturb less. Warm: prepare again on that "
             "cache.",
             "", f"1-minute load average before/after: {meta['load_average_1min'][0]:.1f} / "
             f"{meta['load_average_1min'][1]:.1f} on {meta['cores']} CPUs (shared, noisy)."]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"\n**FAILED**: {r['side']} {r['kind']} run {r['repeat'] + 1}: {r['reason']}"
                         + (f"\n```\n{r['log_tail']}\n```" if r.get("log_tail") else ""))
    return lines
