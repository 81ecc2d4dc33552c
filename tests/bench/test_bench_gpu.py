"""bench/gpu_finetune.py: its arithmetic, cases and reporting without processes, and one dry run on CPU that
launches the trainer (`toolkit.train` through launch.sh) for every case two CPU processes allow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_finetune  # noqa: E402

NAMES = [c.name for c in gpu_finetune.CASES]


@pytest.mark.parametrize("name,preset", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                         ("NVIDIA H200", "h200"), ("NVIDIA H100 NVL", None),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                         ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("NVIDIA L4", "l4"),
                                         ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 4090", "rtx-4090")])
def test_gpu_names_match_presets(name, preset):
    assert gpu_finetune.match_gpu(name) == preset


def test_flops_per_token_gpt2():
    from toolkit.plan.arch import load_arch

    # GPT-2 124M: 124,439,808 parameters less the 1024 x 768 position table; attention 12 * L * s * h.
    flops = gpu_finetune.flops_per_token(load_arch("gpt2"), 1024)
    assert flops["6N"] == 6 * (124_439_808 - 1024 * 768)
    assert flops["6N+attention"] == flops["6N"] + 12 * 12 * 1024 * 768


def test_the_1b_model_is_counted_as_trained(tmp_path):
    """dstk train gives built-ins the byte tokenizer's 257 rows: N is llama-3.2-1b less 128,256 - 257 of
    its (tied) embedding rows, still ~1B."""
    from toolkit.plan.arch import load_arch

    arch = load_arch(str(gpu_finetune.trained_model_dir("llama-3.2-1b", tmp_path)))
    n = gpu_finetune.flops_per_token(arch, 2048)["matmul_params"]
    assert n == load_arch("llama-3.2-1b").num_params() - (128_256 - 257) * 2048
    assert 0.9e9 < n < 1.1e9


@pytest.mark.parametrize("fused", [False, True])
def test_each_case_gets_generate_configs_layout(fused):
    for case in gpu_finetune.CASES:
        cfg = gpu_finetune.ds_config(case, fused)
        assert cfg["pipeline"]["stages"] == case.pp and cfg["zero_optimization"]["stage"] == case.zero
        assert cfg["train_batch_size"] == case.gbs == 8 * case.dp  # 8 sequences per replica per step
        assert cfg["bf16"] == {"enabled": True}
        assert cfg["optimizer"]["params"].get("torch_adam") is (None if fused else True)


def test_cases_that_need_more_gpus_are_skipped_with_the_reason():
    one = dict((c.name, why) for c, why in gpu_finetune.plan_cases(NAMES, 1, dry_run=False))
    assert one["pp1-zero1"] is None and one["pp1-zero3"] is None
    assert one["pp2"] == "needs 2 GPUs, 1 available" and one["pp2-dp2"] == "needs 4 GPUs, 1 available"
    four = {c.name: why for c, why in gpu_finetune.plan_cases(NAMES, 4, dry_run=False)}
    assert all(why is None for name, why in four.items() if name != "pp1-qlora")
    assert "bitsandbytes" in dict((c.name, why) for c, why in gpu_finetune.plan_cases(NAMES, 4, True))["pp1-qlora"]


def test_the_case_runs_the_trainer_through_launch_sh():
    opts = gpu_finetune.parse_args([])
    case = next(c for c in gpu_finetune.CASES if c.name == "pp2-dp2")
    cmd = gpu_finetune.launch_command(case, Path("c.json"), Path("d.txt"), Path("out"), opts)
    assert cmd[:4] == ["bash", str(ROOT / "launch.sh"), "--num-gpus", "4"]
    args = " ".join(cmd[cmd.index("--") + 1:])
    assert "--model llama-3.2-1b" in args and "--seq-len 2048" in args and "--steps 33" in args
    for flag in ("--attention sdpa", "--no-export", "--eval-fraction 0", "--out out"):
        assert flag in args
    assert "--lora" not in args
    lora = next(c for c in gpu_finetune.CASES if c.name == "pp2-lora")
    args = gpu_finetune.launch_command(lora, Path("c.json"), Path("d.txt"), Path("out"), opts)
    assert args[-3:] == ["--lora", "--lora-r", "16"]


def test_tokens_per_s_leaves_out_the_warmup_steps():
    records = [{"step": 1, "tokens_per_s": 1.0}, {"step": 2, "tokens_per_s": 100.0}, {"step": 3, "tokens_per_s": 300.0}]
    # steps 2 and 3 of 600 tokens: 6 s + 2 s for 1200 tokens
    assert gpu_finetune.timed_rate(records, 1, 600) == 150.0


def test_figures_of_a_finished_run(monkeypatch):
    """MFU over all the case's GPUs, the largest rank's peak against the planner, the loss."""
    monkeypatch.setattr(gpu_finetune, "predicted_bytes", lambda *args: int(2.2 * 2**30))
    case, opts = gpu_finetune.CASES[2], gpu_finetune.parse_args([])  # pp2: 2 GPUs, 16,384 tokens a step
    records = [{"step": s, "tokens_per_s": 10.0 if s <= 3 else 1e4, "loss": 6.0 - s / 10} for s in range(1, 34)]
    summary = {"peak_gpu_mib_per_rank": [1000.0, 2048.0], "first_loss": 5.9, "last_loss": 2.7}
    ctx = {"peak_tflops": 1000, "flops": {"6N": 6e9, "6N+attention": 7e9}, "model_dir": None, "preset": "h200"}
    out = gpu_finetune.figures(case, records, summary, ctx, opts)
    assert out["tokens_per_s"] == pytest.approx(1e4) and out["mfu"] == pytest.approx(1e4 * 6e9 / 2e15)
    assert out["peak_gpu_bytes"] == 2 * 2**30 and out["predicted_error"] == pytest.approx(0.1)
    assert out["loss_fell"] and len(out["losses"]) == 33


def test_a_failed_case_is_reported_with_its_log(tmp_path, monkeypatch):
    def crash(cmd, log, env, timeout):
        log.write_text("starting\nRuntimeError: CUDA out of memory\n")
        return 1, 2.0

    monkeypatch.setattr(gpu_finetune, "launch", crash)
    opts = gpu_finetune.parse_args(["--dry-run"])
    entry = gpu_finetune.run_case(gpu_finetune.CASES[0], {"work": tmp_path, "data": tmp_path / "d.txt"}, opts)
    assert entry["status"] == "failed" and entry["reason"] == "exit code 1"
    assert entry["log_tail"].endswith("CUDA out of memory")
    skipped = {**vars(gpu_finetune.CASES[3]), "status": "skipped", "reason": "needs 4 GPUs, 1 available"}
    meta = {"gpu": "g", "peak_tflops": 989, "preset": "h100-sxm", "model": "m", "matmul_params": 1e9,
            "seq_len": 2048, "optimizer": "o", "warmup": 1, "steps": 2}
    text = "\n".join(gpu_finetune.markdown(meta, [entry, skipped]))
    assert "| pp1-zero1 | 1 | 1 x 1 | 1 | 4 x 2 | failed: exit code 1 |" in text
    assert "| pp2-dp2 | 4 | 2 x 2 | 1 | 2 x 4 | skipped: needs 4 GPUs, 1 available |" in text


def test_gpu_finetune_skips_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: this would run the real benchmark")
    assert gpu_finetune.main([]) == 0
    assert "skipped: no CUDA" in capsys.readouterr().out


@pytest.mark.distributed
@pytest.mark.heavy  # five real launches through launch.sh, the bench's own path (~2 min on 2 cores)
def test_gpu_finetune_dry_run_on_cpu(tmp_path):
    """Every case two CPU processes allow runs the trainer (tiny-llama, seq 64, 2 steps); pp2 x dp2 and
    QLoRA (CUDA) are reported as skipped. About 2 minutes on 2 cores (five launches)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the dry run needs a machine without CUDA (DeepSpeed's launcher shows every rank a GPU)")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_finetune.py"), "--dry-run", "--out-dir", str(tmp_path / "out"),
           "--work-dir", str(tmp_path / "work")]
    from tests.conftest import child_env

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "gpu.json").read_text())
    cases = {c["name"]: c for c in result["cases"]}
    assert list(cases) == NAMES
    assert [c["status"] for c in cases.values()] == ["ok", "ok", "ok", "skipped", "ok", "ok", "skipped"]
    lora = cases["pp2-lora"]["summary"]
    assert all(0 < t < p for t, p in zip(lora["trainable_params_per_rank"], lora["params_per_rank"]))  # a frozen base
    assert "needs 4 CPU processes" in cases["pp2-dp2"]["reason"]
    for case in (c for c in cases.values() if c["status"] == "ok"):
        per_rank = case["summary"]["params_per_rank"]  # the trainer's own summary, one entry per rank
        assert len(per_rank) == case["pp"] * case["dp"] and min(per_rank) > 0
        assert case["config"]["pipeline"]["stages"] == case["pp"] and "launch.sh" in case["command"][1]
        assert len(case["losses"]) == 2 and case["first_loss"] == case["losses"][0]
        assert case["last_loss"] == case["losses"][-1] and case["tokens_per_s"] > 0 and case["predicted_bytes"] > 0
    assert sum(cases["pp2"]["summary"]["params_per_rank"]) == result["matmul_params"]  # two stages, one model
    md = (tmp_path / "out" / "gpu.md").read_text()
    assert "| pp2 | 2 | 2 x 1 | 1 | 2 x 4 |" in md and "| pp2-dp2 | 4 | 2 x 2 | 1 | 2 x 4 | skipped:" in md
    real = ROOT / "bench" / "results" / "gpu.json"
    assert not real.exists() or "CPU" not in real.read_text()  # a dry run never overwrites GPU figures
