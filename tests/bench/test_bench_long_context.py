"""bench/long_context.py's plumbing: its corpus (one truncated row per document), the planner's prediction it
reports (activations / sp, no mask under sp), the ALST comparison (from the planner alone), and its tables with
a failed run reported as failed. The measured runs are the benchmark's own (`python bench/long_context.py`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import long_context as bench  # noqa: E402


def test_corpus_holds_documents_longer_than_the_row(tmp_path):
    docs = bench.corpus(tmp_path / "c.txt", 1000, 3).read_text().strip().split("\n\n")
    assert len(docs) == 3 and all(len(d) >= 1064 for d in docs)


def test_the_planner_prediction_halves_with_sp_and_drops_the_mask(tmp_path):
    import json

    model = tmp_path / "m"  # the planner reads config.json alone
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 257, **bench.ARCH}))
    one, two, four = (bench.predicted_activations(model, sp, 4096) for sp in (1, 2, 4))
    assert four * 2 == two and two * 2 < one  # sp 1 also holds the (seq x seq) mask


def test_alst_rows_come_from_the_planner(tmp_path):
    rows = bench.alst_comparison(tmp_path)
    assert [r["gpus"] for r in rows] == [1, 8]
    one, eight = (r["dstk_planned"]["length"] for r in rows)
    assert eight > one and rows[0]["next_length"]["length"] == 2 * one


def test_tables_report_a_failed_run_as_failed():
    lengths = [{"sp": 1, "status": "ok", "longest": 2048, "predicted_longest": 2048, "tried": [
        {"length": 2048, "activation_mib": 130.0, "predicted_mib": 128.0, "tokens_per_s": 10.0}]},
               {"sp": 2, "status": "failed at the base length"}]
    speed = {1: {"runs": [10.0], "median_tokens_per_s": 10.0, "failed": 0, "ratio_to_sp1": 1.0},
             2: {"runs": [None], "median_tokens_per_s": None, "failed": 1, "ratio_to_sp1": None}}
    meta = {"budget_mib": 256, "cpus": 2, "load": [1.0, 1.0], "speed_length": 2048, "reps": 1}
    text = "\n".join(bench.markdown(meta, lengths, speed, []))
    assert "| 2 | 2 | failed: failed at the base length |" in text and "| 2 | failed | - | - | 1 |" in text
    assert "sp 1 1.02" in text
