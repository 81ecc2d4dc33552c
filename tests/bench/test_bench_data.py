"""bench/data_pipeline.py: the generator (size, determinism, exact token count), the commands, the medians and
ratios with failed runs kept, and the table, on fabricated figures (no training processes); one tiny real run
through launch.sh is left to the benchmark itself (bench/data_pipeline.py --quick). Nothing here times anything."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import data_pipeline as bench  # noqa: E402


def test_generator_size_and_determinism(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    meta = bench.generate(a, 0.3, seed=1)
    assert bench.generate(b, 0.3, seed=1) == meta and a.read_bytes() == b.read_bytes()
    bench.generate(c, 0.3, seed=2)
    assert c.read_bytes() != a.read_bytes()
    assert 0.3e6 <= meta["bytes"] == a.stat().st_size < 0.3e6 + 200_000  # stops after the line that reaches mb
    rows = [json.loads(line) for line in a.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == meta["documents"] and all(set(r) == {"text"} for r in rows)
    lengths = sorted(len(r["text"].split()) for r in rows)
    assert lengths[0] < 30 and lengths[-1] > 10 * lengths[len(lengths) // 2]  # varied lengths, a long tail


def test_token_count_is_the_byte_tokenizers(tmp_path):
    """UTF-8 bytes + one end-of-text per document: what the byte tokenizer makes (non-ASCII words included)."""
    from toolkit.train.hf import byte_tokenizer

    path = tmp_path / "d.jsonl"
    meta = bench.generate(path, 0.05)
    tok = byte_tokenizer()
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert any(not t.isascii() for t in texts)
    assert sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts) == meta["tokens"]


def test_dry_run_interleaves_the_cases_and_gives_only_new_a_cache(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "data_pipeline.py"), "--quick", "--repeats", "2",
                           "--dry-run", "--keep", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split("]")[0][1:] for line in lines] == ["old 1", "new-cold 1", "new-warm 1", "old 2", "new-cold 2",
                                                           "new-warm 2"]
    assert all("--num-gpus 2" in line and f"--model {bench.MODEL}" in line and "--no-export" in line for line in lines)
    assert ["--data-cache" in line for line in lines[:3]] == [False, True, True]
    assert f"cd {tmp_path / 'old'} " in lines[0] and f"cd {ROOT} " in lines[1]
    assert lines[1].split("--data-cache")[1] == lines[2].split("--data-cache")[1]  # warm reuses cold's cache


def run(case, n, first, ranks, tree=2000.0, status="ok"):
    return {"case": case, "repeat": n, "status": status, "first_step_s": first, "peak_rss_mib_per_rank": ranks,
            "tree_peak_rss_mib": tree, "reason": "exit code 1", "log_tail": "MemoryError"}


def tok(variant, n, rate, total, warm=None, status="ok"):
    return {"variant": variant, "repeat": n, "status": status, "tokenize_tokens_per_s": rate,
            "total_tokens_per_s": total, "warm_tokens_per_s": warm, "peak_rss_mib": 900.0, "reason": "timed out"}


def fabricated():
    runs = [run("old", 0, 100.0, [9000.0, 8000.0]), run("new-cold", 0, 50.0, [1000.0, 800.0]),
            run("new-warm", 0, 20.0, [700.0, 600.0]),
            run("old", 1, 120.0, [9400.0, 8200.0]), run("new-cold", 1, 60.0, [1200.0, 820.0]),
            run("new-warm", 1, None, None, status="failed")]
    toks = [tok("old", 0, 1e6, 9e5), tok("new", 0, 4e5, 3e5, 8e7), tok("old", 1, 1.2e6, 1.1e6),
            tok("new", 1, None, None, status="failed")]
    return runs, toks


def test_medians_per_rank_and_ratios_to_old_with_failed_runs_kept():
    runs, toks = fabricated()
    out = bench.summarize(runs, toks)
    med, rat = out["medians"], out["ratios"]
    assert med["old"]["first_step_s"] == 110.0 and med["old"]["peak_rss_mib_per_rank"] == [9200.0, 8100.0]
    assert med["new-warm"]["ok"] == 1 and med["new-warm"]["runs"] == 2 and med["new-warm"]["first_step_s"] == 20.0
    assert rat["new-cold"]["first_step_s"] == pytest.approx(55 / 110)
    assert rat["new-cold"]["peak_rss_mib_per_rank"] == pytest.approx([1100 / 9200, 810 / 8100])
    assert med["new-cold"]["tokenize_ok"] == 1 and med["old"]["tokenize_tokens_per_s"] == 1.1e6
    assert rat["new-cold"]["tokenize_tokens_per_s"] == pytest.approx(4e5 / 1.1e6)
    assert rat["new-warm"]["tokenize_tokens_per_s"] == pytest.approx(8e7 / 1.1e6)
    assert rat["new-warm"]["total_tokens_per_s"] is None  # the warm case has no file -> rows figure


def test_a_case_with_every_run_failed_reads_failed():
    runs = [run("old", 0, None, None, status="failed"), run("new-cold", 0, 50.0, [1000.0, 800.0]),
            run("new-warm", 0, 20.0, [700.0, 600.0])]
    result = bench.summarize(runs, [tok("old", 0, 1e6, 9e5), tok("new", 0, 4e5, 3e5, 8e7)])
    row = next(line for line in bench.table(result) if line.startswith("| time to first step"))
    assert row == "| time to first step (s) | failed | 50.0 | 20.0 | - | - |"


def test_table_format():
    runs, toks = fabricated()
    lines = bench.table(bench.summarize(runs, toks))
    assert lines[0] == "| | old reader | new, cold cache | new, warm cache | new cold / old | new warm / old |"
    assert lines[1] == "|---|---:|---:|---:|---:|---:|"
    assert "| time to first step (s) | 110.0 | 55.0 | 20.0 (1 of 2 ok) | 0.500 | 0.182 |" in lines
    assert ("| peak RSS MiB per rank (rank 0 / rank 1) | 9200 / 8100 | 1100 / 810 | 700 / 600 (1 of 2 ok) | "
            "0.120 / 0.100 | 0.076 / 0.074 |") in lines
    assert ("| tokenization tokens/s (in-process) | 1,100,000 | 400,000 (1 of 2 ok) | 80,000,000 (1 of 2 ok) | "
            "0.364 | 72.727 |") in lines
    assert ("| file -> rows tokens/s (in-process, read included) | 1,000,000 | 300,000 (1 of 2 ok) | - | 0.300 | - |"
            in lines)


def test_markdown_names_every_failure(tmp_path):
    runs, toks = fabricated()
    meta = {"mb": 20, "repeats": 2, "data": {"bytes": 20_000_100, "documents": 15_000, "tokens": 19_900_000, "seed": 0},
            "ram_gib": 23.5, "new_workers": 1, "load_average_1min": [1.0, 2.0], "platform": "Linux-x", "cpus": 2}
    text = "\n".join(bench.markdown(bench.summarize(runs, toks), meta, runs, toks))
    assert "20.0 MB of synthetic JSON lines (`--mb 20`, seed 0): 15,000 documents, 19,900,000 tokens" in text
    assert "**FAILED**: new-warm run 2: exit code 1" in text and "MemoryError" in text
    assert "**FAILED**: new tokenization 2: timed out" in text


import data_throughput as throughput  # noqa: E402


def test_chat_generator_size_and_determinism(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    meta = throughput.generate_chat(a, 0.05, seed=3)
    assert throughput.generate_chat(b, 0.05, seed=3) == meta and a.read_bytes() == b.read_bytes()
    rows = [json.loads(line)["messages"] for line in a.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == meta["rows"] and 0.05e6 <= meta["bytes"] == a.stat().st_size
    assert all([m["role"] for m in r if m["role"] != "system"] == ["user", "assistant"] * (len(r) // 2) for r in rows)
    assert {len(r) for r in rows} >= {2, 4, 6}


def measured(side, kind, n, seconds, cpu, status="ok", tokens=1_000_000):
    return {"side": side, "kind": kind, "repeat": n, "status": status, "seconds": seconds, "cpu_seconds": cpu,
            "tokens": tokens, "documents": 10, "warm_seconds": 1.0, "reason": "exit code 1", "log_tail": "boom"}


def test_throughput_medians_ratios_and_failed_runs_kept():
    runs = [measured("raw", "text", 0, 10.0, 18.0), measured("dstk", "text", 0, 12.0, 20.0),
            measured("raw", "text", 1, 20.0, 19.0), measured("dstk", "text", 1, 10.0, 21.0),
            measured("raw", "text", 2, 11.0, 18.5), measured("dstk", "text", 2, None, None, status="failed"),
            measured("raw", "chat", 0, None, None, status="failed")]
    out = throughput.summarize(runs)
    text = out["text"]
    assert text["raw"]["seconds"] == 11.0 and text["dstk"]["seconds"] == 11.0 and text["dstk"]["ok"] == 2
    assert text["ratio"] == pytest.approx(1.0) and text["cpu_ratio"] == pytest.approx(18.5 / 20.5)
    assert text["raw"]["tokens_per_s"] == pytest.approx(1e6 / 11)
    assert out["chat"]["ratio"] is None and out["chat"]["raw"]["ok"] == 0
    lines = throughput.table(out)
    assert lines[2].startswith("| text | 1,000,000 | 90,909 | 90,909 (2 of 3 ok) | 1.000 |")
    assert lines[3].startswith("| chat | 0 | failed | failed | - |")
    meta = {"data": {"text": {"bytes": 2e6, "documents": 10}, "chat": {"bytes": 1e6, "rows": 5}}, "vocab": 32000,
            "seq_len": 2048, "cores": 2, "repeats": 3, "load_average_1min": [1.0, 2.0]}
    text_md = "\n".join(throughput.markdown(out, meta, runs))
    assert "**FAILED**: dstk text run 3: exit code 1" in text_md and "boom" in text_md


@pytest.mark.heavy
def test_a_tiny_throughput_run_end_to_end(tmp_path):
    """The whole --throughput path on a tiny corpus: tokenizer training, raw and dstk children, the report."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "data_pipeline.py"), "--throughput", "--mb", "0.3",
                           "--chat-mb", "0.1", "--repeats", "1", "--keep", str(tmp_path), "--no-record"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["side"], r["kind"]) for r in runs] == [("raw", "text"), ("dstk", "text"), ("raw", "chat"),
                                                      ("dstk", "chat")]
    assert all(r["status"] == "ok" and r["seconds"] > 0 for r in runs)
    assert runs[1]["format"] == "text" and runs[3]["format"] == "chat"
    assert "| text | " in proc.stdout and "| chat | " in proc.stdout
