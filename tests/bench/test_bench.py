"""The benchmark harness (bench/): fast checks of its plumbing and arithmetic (the GPU script's are in
test_bench_gpu.py). Nothing here times anything or depends on how fast the machine is."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import plan_accuracy  # noqa: E402
import run_all  # noqa: E402


def test_summarize_medians_and_ratios():
    out = common.summarize({"a": [3.0, 1.0, 2.0], "b": [4.0, 8.0, 6.0, 5.0]}, baseline="a")
    assert out["a"]["median_s"] == 2.0 and out["b"]["median_s"] == 5.5  # even count: mean of the middle two
    assert out["a"]["ratio_to_a"] == 1.0 and out["b"]["ratio_to_a"] == 2.75
    assert out["b"]["runs_s"] == [4.0, 8.0, 6.0, 5.0]  # every repetition kept, in order


def test_alternate_runs_cases_round_by_round():
    order = []
    samples = common.alternate({"A": lambda: order.append("A") or 1.0, "B": lambda: order.append("B") or 2.0}, 3)
    assert order == ["A", "B"] * 3 and samples == {"A": [1.0] * 3, "B": [2.0] * 3}


def test_run_all_help_and_list():
    for flag in ("--help", "--list"):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run_all.py"), flag], capture_output=True,
                              text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "plan" in proc.stdout and "gpu" in proc.stdout


def test_run_all_flags_are_declared_by_each_script():
    """Every flag run_all passes is declared by the script's argparse: a renamed flag fails here, not in
    `make bench`."""
    for name, (script, quick, full) in run_all.SCRIPTS.items():
        path = ROOT / "bench" / script
        if not path.exists():
            continue  # being written
        for flag in (a for a in quick + full if a.startswith("--")):
            assert f'"{flag}"' in path.read_text(), (name, flag)


def test_run_all_skips_a_missing_script(monkeypatch, capsys):
    monkeypatch.setitem(run_all.SCRIPTS, "nope", ("does_not_exist.py", [], []))
    assert run_all.run_one("nope", "quick", None)["status"] == "missing"
    assert "does not exist" in capsys.readouterr().out


def test_plan_accuracy_table_from_measured_bytes():
    _, _, states = plan_accuracy.predicted(zero=1, pp=1)
    held = {"params": 2_101_248, "moments": {"backward": states.peak // 2, "step": states.peak}}
    fake = {rank: {key: held for key, *_ in plan_accuracy.cases()} for rank in (0, 1)}
    row = next(r for r in plan_accuracy.table(fake) if r["zero"] == 1 and r["pp"] == 1 and not r["lora_r"])
    assert row["error"] == 0.0 and row["measured_bytes"] == [states.peak] * 2  # the larger moment counts
    assert any("| ZeRO-1, pp 1, dp 2 |" in line for line in plan_accuracy.markdown(plan_accuracy.table(fake)))


def test_plan_accuracy_lora_rows_predict_a_frozen_base():
    """The LoRA rows are predicted with the adapters alone trainable: far below the same stage fully trained."""
    keys = [key for key, *_ in plan_accuracy.cases()]
    assert "lora-zero1-pp2" in keys and "lora-zero0-pp2" in keys and "lora-zero1-pp1" in keys
    params, trainable, lora = plan_accuracy.predicted(zero=1, pp=2, lora=8)
    full_params, full_trainable, full = plan_accuracy.predicted(zero=1, pp=2)
    assert params == full_params + 4 * 8 * (512 + 512) and trainable == 4 * 8 * (512 + 512)
    assert lora.peak < 0.3 * full.peak and lora.optimizer == 8 * trainable
    fake = {rank: {key: {"params": 1, "moments": {"step": 1}} for key in keys} for rank in (0, 1)}
    lines = plan_accuracy.markdown(plan_accuracy.table(fake))
    assert any(line.startswith("| ZeRO-1, pp 2, dp 1, LoRA r=8 | 1,083,392 (32,768) |") for line in lines), lines


def test_plan_accuracy_activation_rows_measure_a_real_step():
    """bench/plan_accuracy.py's activation table on tiny-gpt2 (under a second): the planner's activations +
    loss peak within 10% of the measured peak; the old 4 x tokens x vocab loss term a third short."""
    row = plan_accuracy.activation_case("tiny-gpt2", 2, 64, 2)
    assert 0.9 < row["predicted_bytes"] / row["measured_bytes"] < 1.1
    assert row["predicted_before_bytes"] / row["measured_bytes"] < 0.75
    assert row["loss_peak_bytes"] == 12 * row["tokens_x_vocab"]
    assert "| tiny-gpt2 widths, 2 block(s), vocab 512, 2 x 64 tokens |" in plan_accuracy.activation_markdown([row])[2]
