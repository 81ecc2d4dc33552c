"""bench/lora_vs_full.py: its commands, arithmetic, failure path and table on fabricated summaries (no processes),
and one tiny real run through launch.sh (marked distributed). Nothing here times anything."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import lora_vs_full as bench  # noqa: E402

STATES = {"lora": [55.9, 56.1], "full": [146.3, 146.4]}  # MiB per rank, fabricated


def fake_run(case: str, n: int, rate: float) -> dict:
    """A run's figures as run_one returns them, made up for the formatting and arithmetic."""
    base = [1_000, 1_200]
    adapters = [100, 120] if case == "lora" else [0, 0]
    params = [b + a for b, a in zip(base, adapters)]
    return {"case": case, "repeat": n, "tokens_per_s": rate, "params_per_rank": params,
            "trainable_params_per_rank": adapters if case == "lora" else params,
            "model_state_mib_per_rank": STATES[case], "peak_rss_mib_per_rank": [700.0 + n, 650.0] if case == "lora"
            else [800.0, 800.0 + n]}


def test_dry_run_alternates_lora_and_full():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lora_vs_full.py"), "--dry-run", "--repeats", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("bash ")]
    assert len(runs) == 4
    assert ["--lora-r 16" in line for line in runs] == [True, False, True, False]
    assert all("--num-gpus 2" in line and "--seq-len 128" in line and "--steps 12" in line for line in runs)
    assert '"stages": 2' in proc.stdout and '"torch_adam": true' in proc.stdout


def test_config_is_fp32_torch_adamw_with_the_layouts_pipeline():
    cfg = bench.ds_config(pp=2)
    assert cfg["pipeline"] == {"stages": 2} and cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["gradient_clipping"] == 0.0 and "bf16" not in cfg and "fp16" not in cfg


@pytest.mark.parametrize("argv", [["--pp", "2", "--procs", "3"], ["--steps", "3", "--warmup", "3"],
                                  ["--repeats", "0"]])
def test_impossible_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_measure_takes_the_median_after_the_warmup():
    records = [{"step": s, "tokens_per_s": r} for s, r in enumerate([10.0, 500.0, 300.0, 100.0, 200.0], 1)]
    summary = {"model_state_mib_per_rank": [1.0], "params_per_rank": [5]}
    out = bench.measure(records, summary, warmup=1)
    assert out["tokens_per_s"] == 250.0 and out["steps_timed"] == 4 and out["params_per_rank"] == [5]
    with pytest.raises(bench.BenchFailed, match="no summary"):
        bench.measure(records, None, warmup=1)
    with pytest.raises(bench.BenchFailed, match="warm-up"):
        bench.measure(records, summary, warmup=5)


def test_summarize_medians_and_ratios_per_rank():
    runs = [fake_run(c, n, rate) for n, (lo, fu) in enumerate([(300, 200), (330, 250), (310, 220)])
            for c, rate in (("lora", lo), ("full", fu))]
    out = bench.summarize(runs)
    med, ratio = out["medians"], out["ratios"]
    assert med["lora"]["tokens_per_s"] == 310 and med["full"]["tokens_per_s"] == 220
    assert ratio["tokens_per_s"] == pytest.approx(310 / 220)
    assert ratio["tokens_per_s_paired"] == pytest.approx(310 / 220)  # median of 300/200, 330/250, 310/220
    assert med["full"]["tokens_per_s_range"] == [200, 250]
    assert ratio["model_state_mib_per_rank"] == pytest.approx([55.9 / 146.3, 56.1 / 146.4])
    assert med["lora"]["peak_rss_mib_per_rank"] == [701.0, 650.0]  # rank by rank, over the repeats
    assert ratio["peak_rss_mib_per_rank"] == pytest.approx([701 / 800, 650 / 801])


def test_runs_that_do_not_train_what_they_say_fail_the_bench():
    lora_all = dict(fake_run("lora", 0, 1.0), trainable_params_per_rank=[1_100, 1_320])
    with pytest.raises(bench.BenchFailed, match="LoRA rank 0"):
        bench.summarize([lora_all, fake_run("full", 0, 1.0)])
    frozen_full = dict(fake_run("full", 0, 1.0), trainable_params_per_rank=[0, 0])
    with pytest.raises(bench.BenchFailed, match="full fine-tuning"):
        bench.summarize([fake_run("lora", 0, 1.0), frozen_full])
    with pytest.raises(bench.BenchFailed, match="no full runs"):
        bench.summarize([fake_run("lora", 0, 1.0)])


def test_markdown_table_from_fabricated_summaries():
    result = bench.summarize([fake_run("lora", 0, 330.0), fake_run("full", 0, 220.0)])
    meta = {"pp": 2, "dp": 1, "procs": 2, "model": "m", "repeats": 1, "steps": 4, "warmup": 1, "cpus": 2,
            "platform": "Linux-x", "load_average_1min": [1.0, 2.0], "load_average_runs": [3.5],
            "plan": {"skipped": "dstk plan has no --lora option"}}
    text = "\n".join(bench.markdown(result, meta))
    assert "| tokens/s (median per-step; runs' range) | 330 (330-330) | 220 (220-220) | 1.500 |" in text
    assert "| tokens/s, median of paired ratios (run n LoRA / run n full) | | | 1.500 |" in text
    assert "| model-state MiB per rank | 55.9 / 56.1 | 146.3 / 146.4 | 0.382 / 0.383 |" in text
    assert "| parameters per rank (trainable) | 1,100 (100) / 1,320 (120) |" in text
    assert "prediction: skipped (dstk plan has no --lora option)" in text and "Linux-x" in text
    assert "highest 3.5" in text and "other work shared the machine" in text  # load 3.5 > 2 CPUs


def test_reading_explains_the_states_in_multiples_of_the_weights():
    """fp32: 4 bytes a weight; at the end the full run holds weights + 2 Adam states (3 x), LoRA adds 12 bytes
    per adapter parameter to its frozen base (numbers shaped like a real pp 2 run's rank 0)."""
    weights = 12_784_128 * 4 / 2**20
    med = {"full": {"params_per_rank": [12_784_128], "model_state_mib_per_rank": [3 * weights]},
           "lora": {"trainable_params_per_rank": [624_640],
                    "model_state_mib_per_rank": [weights + 624_640 * 12 / 2**20]}}
    text = bench.reading(med, {"tokens_per_s": 1.26})[0]
    assert "frozen fp32 base (48.8 MiB) plus 7.1 MiB for 624,640 adapter parameters (12.0 bytes each)" in text
    assert "3.00 x the weights (weights and two Adam states" in text and "by a factor 1.26" in text


def test_plan_prediction_for_the_benchs_model(tmp_path):
    """dstk plan's model states for the bench's layout: LoRA keeps the frozen weights plus 4 x 4 bytes per
    adapter parameter (weight, gradient, 2 Adam states), full 4 x 4 bytes per parameter."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=257, **bench.MODEL).to_json_file(tmp_path / "config.json")
    plan = bench.predicted(tmp_path, pp=2, procs=2)
    if "skipped" in plan:
        pytest.skip(plan["skipped"])
    assert plan["layout"] == "pp=2 dp=1 zero=0 mbs=2 gas=4"
    assert 0.25 < plan["ratio"] < 0.35  # ~ weights / (4 x weights) plus the adapters' states
    assert plan["full"]["model_state_mib"] > 150


def test_a_failed_run_fails_the_bench_with_no_table(tmp_path, monkeypatch, capsys):
    """launch.sh exiting 1 (faked): exit 1, the failure printed and written, no table in results/lora.md."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "build_model", lambda path: 25_000_000)
    monkeypatch.setattr(bench, "predicted", lambda *a: {"skipped": "test"})

    def launch(cmd, log, env, timeout):
        log.write_text("Traceback ...\nRuntimeError: boom\n")
        return 1, 0.1

    monkeypatch.setattr(bench, "launch", launch)
    assert bench.main(["--repeats", "1", "--steps", "2", "--warmup", "1"]) == 1
    assert "RuntimeError: boom" in capsys.readouterr().err
    md = (tmp_path / "lora.md").read_text()
    assert "FAILED" in md and "boom" in md and "| tokens/s" not in md
    assert json.loads((tmp_path / "lora.json").read_text())["status"] == "failed"


@pytest.mark.distributed
@pytest.mark.heavy  # a real bench run of two layouts: ~40 s
def test_a_tiny_real_run(tmp_path, monkeypatch):
    """One LoRA and one full run of a 2-block model through launch.sh, on one process (the cheapest launch, ~50 s on
    2 shared cores; the bench's own pp 2 runs take minutes): the summary's lists reach the table."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "MODEL", dict(bench.MODEL, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    argv = ["--repeats", "1", "--steps", "2", "--warmup", "1", "--pp", "1", "--procs", "1", "--timeout", "120"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "lora.json").read_text())
    lora, full = result["medians"]["lora"], result["medians"]["full"]
    assert result["status"] == "ok" and len(lora["model_state_mib_per_rank"]) == 1
    assert all(r < 1 for r in result["ratios"]["model_state_mib_per_rank"])
    assert sum(lora["trainable_params_per_rank"]) < sum(full["trainable_params_per_rank"])
