"""The benchmark harness (bench/): fast checks of its plumbing and arithmetic, and one dry run of the GPU
script on CPU. Nothing here times anything or depends on how fast the machine is."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import gpu_finetune  # noqa: E402
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


@pytest.mark.parametrize("name,preset", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                         ("NVIDIA H200", "h200"), ("NVIDIA H100 NVL", None),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                         ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("NVIDIA L4", "l4"),
                                         ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 4090", "rtx-4090")])
def test_gpu_names_match_presets(name, preset):
    assert gpu_finetune.match_gpu(name) == preset


def test_flops_per_token_gpt2():
    # GPT-2 124M: 124,439,808 parameters less the 1024 x 768 position table; attention 12 * L * s * h.
    assert gpu_finetune.flops_per_token("gpt2", 1024) == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 1024 * 768


def test_both_paths_train_the_same_thing():
    dstk, plain = gpu_finetune.dstk_config(4, 2, fused=False), gpu_finetune.plain_config(4, 2, fused=False)
    for cfg in (dstk, plain):
        assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["zero_optimization"]["stage"] == 2
        assert cfg["bf16"] == {"enabled": True} and cfg["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in gpu_finetune.dstk_config(4, 1, fused=True)["optimizer"]["params"]


def test_plan_accuracy_table_from_measured_bytes():
    _, states = plan_accuracy.predicted(zero=1, pp=1)
    held = {"zero1-pp1": {"params": 2_101_248, "moments": {"backward": states.peak // 2, "step": states.peak}}}
    fake = {rank: {f"zero{z}-pp{p}": held["zero1-pp1"] for z, p in [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2)]}
            for rank in (0, 1)}
    row = next(r for r in plan_accuracy.table(fake) if r["zero"] == 1 and r["pp"] == 1)
    assert row["error"] == 0.0 and row["measured_bytes"] == [states.peak] * 2  # the larger moment counts
    assert any("| ZeRO-1, pp 1, dp 2 |" in line for line in plan_accuracy.markdown(plan_accuracy.table(fake)))


def test_gpu_finetune_skips_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: this would run the real benchmark")
    assert gpu_finetune.main([]) == 0
    assert "skipped: no CUDA" in capsys.readouterr().out


def test_gpu_finetune_dry_run_on_cpu(tmp_path):
    """The GPU script's whole code path on CPU (one tiny model, ZeRO-2, both paths, 1 step each); about 15 s."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_finetune.py"), "--dry-run", "--models", "tiny-llama",
           "--zero", "2", "--warmup", "0", "--steps", "1", "--out-dir", str(tmp_path)]
    from tests.conftest import child_env

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    (case,) = result["cases"]
    assert case["configs"]["dstk"]["zero_optimization"]["stage"] == 2
    for path in ("dstk", "plain"):
        run = case["paths"][path]["runs"][0]
        assert len(run["step_s"]) == 1 and run["engine_freed"]  # freed: the next case starts from nothing
        assert case["paths"][path]["predicted_bytes"] > 0
    assert "| tiny-llama | 64 x 2 | 2 | dstk |" in (tmp_path / "gpu.md").read_text()
    assert not (ROOT / "bench" / "results" / "gpu.json").exists() or "CPU" not in \
        (ROOT / "bench" / "results" / "gpu.json").read_text()  # a dry run never overwrites GPU figures
