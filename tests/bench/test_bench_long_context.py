"""bench/long_context.py's plumbing: its corpus (one truncated row per document), the planner's prediction it
reports per row of features, the search for the longest length (over a stand-in for the runs: the arithmetic alone),
a run stopped past its memory limit (a real process group), the ALST comparison (from the planner alone), and its
tables with a failed run reported as failed. The measured runs are the benchmark's own (`python
bench/long_context.py`)."""

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench import long_context as bench  # noqa: E402
from bench import long_context_tables as tables  # noqa: E402


def _config(tmp_path, vocab: int) -> Path:
    model = tmp_path / "m"  # the planner reads config.json alone
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab, **bench.ARCH}))
    return model


def test_corpus_holds_documents_longer_than_the_row(tmp_path):
    docs = bench.corpus(tmp_path / "c.txt", 1000, 3).read_text().strip().split("\n\n")
    assert len(docs) == 3 and all(len(d) >= 1064 for d in docs)


def test_the_planner_prediction_halves_with_sp_and_drops_the_mask(tmp_path):
    model = _config(tmp_path, 257)
    one, two, four = (bench.predicted_activations(model, sp, 4096) for sp in (1, 2, 4))
    assert four * 2 == two and two * 2 < one  # sp 1 also holds the (seq x seq) mask


def test_each_row_adds_a_feature_the_planner_counts(tmp_path):
    """At 16384 tokens under sp 2 with a 32000-token vocabulary every row's feature takes activations off the row
    before it (or none, the tiled MLP's, where the head's recompute is the peak), and the defaults tile the loss there (a rank's logits pass --tiled-loss auto's 512 MiB)."""
    model = _config(tmp_path, bench.VOCAB)
    rows = {row.name: row for row in bench.ROWS}
    share = {name: bench.predicted_share(model, 2, 16384, row) for name, row in rows.items()}
    # with checkpointing the stage peaks at the head's recompute (the tiled loss's tiles), not at a block's MLP
    assert share["baseline"] > share["+ checkpointing"] > 5 * share["+ tiled loss"] >= 5 * share["+ tiled MLP"]
    assert share["all (defaults)"] == share["+ tiled loss"]
    longest = {name: bench.predicted_longest(model, 2, row, 256, bisect=False) for name, row in rows.items()}
    assert longest["baseline"] < longest["+ tiled loss"] <= longest["+ tiled MLP"]


def test_a_tiled_run_is_compared_with_the_head_gradient_it_holds_at_its_peak(tmp_path):
    """The tiled loss sums the head's weight gradient from its first tile, so it is alive at a tiled run's peak and
    not at the whole-logits baseline's: the planner's figure above the baseline carries it (hidden x vocab fp32)
    exactly where the row's loss is tiled at that length."""
    model = _config(tmp_path, bench.VOCAB)
    rows = {row.name: row for row in bench.ROWS}
    head = 4 * bench.ARCH["hidden_size"] * bench.VOCAB / 2**20
    for sp, length in ((1, 2048), (2, 8192)):
        acts = {n: (bench.predicted_activations(model, sp, length, r)
                    - bench.predicted_activations(model, sp, bench.base_len(sp))) / 2**20 for n, r in rows.items()}
        assert bench.predicted_share(model, sp, length, rows["+ tiled loss"]) == acts["+ tiled loss"] + head
        assert bench.predicted_share(model, sp, length, rows["+ checkpointing"]) == acts["+ checkpointing"]
    # the defaults tile from 4096 tokens per rank here: at 2048 the share is checkpointing's, no gradient added
    assert bench.predicted_share(model, 1, 2048, rows["all (defaults)"]) == pytest.approx(
        bench.predicted_share(model, 1, 2048, rows["+ checkpointing"]))


def _search(tmp_path, mib_per_token: float, start: int = 1024, **options) -> tuple:
    """Bench.longest over a stand-in for the runs: `mib_per_token` x length MiB of activations (budget 100 MiB)."""
    args = SimpleNamespace(**{"budget_mib": 100, "cap": 8192, "bisect": False, "kill_at": 0, "steps": 1, **options})
    runs = bench.Bench(_config(tmp_path, 257), args, tmp_path)
    tried = []

    def attempt(row, sp, length):
        tried.append(length)
        return {"length": length, "status": "fits" if mib_per_token * length <= 100 else "over"}

    runs.attempt = attempt
    return runs.longest(bench.ROWS[0], 1, start), tried


def test_the_search_doubles_halves_bisects_and_stops_at_the_cap(tmp_path):
    found, tried = _search(tmp_path / "a", 100 / 3500)  # 3500 tokens fit
    assert found["longest"] == 2048 and tried == [1024, 2048, 4096] and not found["capped"]
    found, tried = _search(tmp_path / "b", 100 / 1500, start=8192)  # 1500 tokens fit: the start halves
    assert found["longest"] == 1024 and tried == [8192, 4096, 2048, 1024]
    found, tried = _search(tmp_path / "e", 100 / 300, start=512)  # never below twice the baseline's 512 tokens
    assert found["longest"] is None and tried == [1024]
    found, tried = _search(tmp_path / "c", 100 / 3500, bisect=True)
    assert found["longest"] == 3072 and tried == [1024, 2048, 4096, 3072]
    found, tried = _search(tmp_path / "d", 100 / 10**6)
    assert found["longest"] == 8192 and found["capped"] and tried == [1024, 2048, 4096, 8192]


def test_a_run_past_its_memory_limit_is_stopped(tmp_path):
    """common.launch's watch on common.tree_peak_mib: a process whose child, in a session of its own (as DeepSpeed's
    runner starts), holds 300 MiB is stopped at a 200 MiB limit within seconds (exit code None), not at its 60 s
    timeout."""
    child = "import time; b = bytearray(300 * 2**20); time.sleep(8)"
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}], "
            "start_new_session=True); time.sleep(60)")
    start = time.perf_counter()
    rc, _ = common.launch([sys.executable, "-c", code], tmp_path / "log", {}, timeout=60,
                          watch=lambda pid: common.tree_peak_mib(pid) > 200)
    assert rc is None and time.perf_counter() - start < 40
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert 0 < common.tree_peak_mib(proc.pid) < 200  # the interpreter alone
    finally:
        proc.kill()
        proc.wait()


def test_alst_rows_come_from_the_planner(tmp_path):
    rows = bench.alst_comparison(tmp_path)
    assert [r["gpus"] for r in rows] == [1, 8]
    one, eight = (r["dstk_planned"]["length"] for r in rows)
    assert eight > one and one < rows[0]["next_length"]["length"] <= one * 17 // 16  # the gap halved 4 times
    assert "checkpoints in host memory" in rows[0]["dstk_planned"]["features"]


def test_tables_report_a_failed_run_as_failed():
    ok = {"row": "baseline", "flags": "no checkpointing", "sp": 1, "status": "ok", "longest": 2048, "capped": False,
          "predicted_longest": 4096, "tried": [
              {"length": 2048, "status": "fits", "activation_mib": 90.0, "predicted_mib": 100.0, "ratio": 0.9},
              {"length": 4096, "status": "killed", "activation_mib": 130.0, "predicted_mib": 200.0, "ratio": 0.65}]}
    failed = {"row": "baseline", "flags": "no checkpointing", "sp": 2, "status": "failed at the base length"}
    meta = {"model": "Model.", "base_tokens": 512, "zero": 0, "budget_mib": 100, "cap": 8192, "bisect": False, "kill_at": 1.25,
            "sps": [1, 2], "cpus": 2, "load": [1.0, 1.0]}
    text = "\n".join(tables.markdown(meta, [[ok, failed]], [{"length": None}], []))
    row = "| baseline: no checkpointing | 2048 (planner 4096) | failed: failed at the base length | 0.90 (sp 1, 2048) |"
    assert row in text  # the stopped run's ratio is a bound, not a measure: not the worst
    assert "4096: > 130 / 200 MiB, stopped" in text and "on a CPU the host is the device" in text


def test_tokens_per_s_at_the_rows_common_length(tmp_path):
    """The median per-step tokens/s (first steps left out) at the longest length every sp trained: the search's run
    there, and one more run where the search did not run that length (sp 2 started above it)."""
    args = SimpleNamespace(reps=1, steps=3)
    runs = bench.Bench(tmp_path, args, tmp_path)
    launched = []
    runs.launch = lambda row, sp, length: launched.append((sp, length)) or {"step_tokens_per_s": [1.0, 30.0, 50.0]}
    cells = [{"row": "baseline", "sp": 1, "longest": 2048, "tried": [
                 {"length": 1024, "step_tokens_per_s": [1.0, 8.0, 8.0]},
                 {"length": 2048, "step_tokens_per_s": [1.0, 10.0, 20.0]}]},
             {"row": "baseline", "sp": 2, "longest": 4096, "tried": [{"length": 4096, "step_tokens_per_s": [1.0, 9.0]}]}]
    speed = runs.speed(cells)
    assert speed["length"] == 2048 and launched == [(2, 2048)]
    assert speed["median_tokens_per_s"] == {1: 15.0, 2: 40.0}


def test_the_defaults_reuse_a_run_whose_flags_settle_alike(tmp_path):
    """At 1024 tokens --tiled-loss/--tiled-mlp auto turn nothing on: the defaults' row takes + checkpointing's run;
    at 8192 tokens on one rank auto tiles the loss (1 GiB of logits): a run of its own."""
    args = SimpleNamespace(budget_mib=256, kill_at=0, steps=1)
    runs = bench.Bench(_config(tmp_path, bench.VOCAB), args, tmp_path)
    runs.base[1] = 1000.0
    launched = []
    runs.launch = lambda row, sp, length, limit: launched.append((row.name, length)) or {"peak_mib": 1100.0, "wall_s": 1}
    rows = {row.name: row for row in bench.ROWS}
    for name, length in (("+ checkpointing", 1024), ("all (defaults)", 1024), ("+ checkpointing", 8192),
                         ("all (defaults)", 8192)):
        assert runs.attempt(rows[name], 1, length)["activation_mib"] == 100.0
    assert launched == [("+ checkpointing", 1024), ("+ checkpointing", 8192), ("all (defaults)", 8192)]
