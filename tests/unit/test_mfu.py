"""MFU: FLOPs per token from the planner's cost model, the peak from the one GPU table (device names
matched to presets), and what a run's last lines say about it (tokens/s always, MFU on CUDA only)."""

from dataclasses import replace

import pytest

from toolkit.errors import ConfigError
from toolkit.plan.arch import load_arch
from toolkit.plan.gpus import GPUS, get_gpu, preset_for_device
from toolkit.plan.cost.mfu import flops_per_token, peak_tflops, utilisation
from toolkit.train.report import mfu_fields, table
from toolkit.train.runner import TrainArgs


@pytest.mark.parametrize("name,preset", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                         ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200"),
                                         ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                         ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("NVIDIA L4", "l4"),
                                         ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"),
                                         ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Tesla V100-SXM2-16GB", "v100-16gb")])
def test_device_names_match_presets(name, preset):
    assert preset_for_device(name) == preset
    assert preset is None or preset in GPUS


def test_datasheet_peaks_are_dense_bf16():
    """The figures MFU divides by: dense (half the 'with sparsity' figure), bf16."""
    assert {name: GPUS[name].bf16_tflops for name in ("a100-80gb", "h100-sxm", "h100-pcie", "h100-nvl", "h200", "l40s")} \
        == {"a100-80gb": 312, "h100-sxm": 989, "h100-pcie": 756, "h100-nvl": 835, "h200": 989, "l40s": 362}
    assert peak_tflops("NVIDIA H200", "bf16") == ("h200", 989)
    with pytest.raises(ConfigError, match="no preset"):
        peak_tflops("NVIDIA GH200 480GB", "bf16")
    with pytest.raises(ConfigError, match="no bf16"):
        peak_tflops("Tesla V100-SXM2-32GB", "bf16")
    assert get_gpu("h100").name == "h100-sxm"  # the NVL is asked for by name


def test_flops_per_token_is_6n_plus_attention():
    """GPT-2 124M at seq 1024: 6N (N without the position table; the tied embedding once, as the head) plus
    12 L s h_attn, and the cost model's small elementwise terms (under 1%)."""
    n = 124_439_808 - 1024 * 768
    closed = 6 * n + 12 * 12 * 1024 * 768
    assert closed < flops_per_token(load_arch("gpt2"), 1024) < 1.01 * closed
    llama = load_arch("llama-3.2-1b")
    full, lora = flops_per_token(llama, 2048), flops_per_token(llama, 2048, lora=16)
    assert 0.6 * full < lora < 0.75 * full  # frozen weights: 4N of 6N, attention and adapters unchanged


def test_mfu_is_over_every_gpu():
    assert utilisation(1e4, 8e9, 2, 1000) == pytest.approx(1e4 * 8e9 / 2e15)


def _run(**kw):
    return TrainArgs(model="tiny-llama", data="d.txt", config="c.json", seq_len=128, **kw)


def test_mfu_fields_on_cuda_and_without_it():
    config = {"model_type": "gpt2", "vocab_size": 257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}
    flops = flops_per_token(replace(load_arch("gpt2"), vocab=257), 128)  # GPT-2's shape, a byte tokenizer's vocabulary
    on_gpu = mfu_fields(5e4, config, _run(), "bf16", "NVIDIA H100 80GB HBM3", 2)
    assert on_gpu["flops_per_token"] == pytest.approx(flops)
    assert on_gpu["mfu"] == pytest.approx(5e4 * flops / (2 * 989e12))
    assert on_gpu["mfu_note"] == "2 GPUs x h100-sxm, 989 bf16 TFLOPs"
    cpu = mfu_fields(5e4, config, _run(), "bf16", None, 2)
    assert cpu["mfu"] is None and cpu["gpu"] is None and "no CUDA device" in cpu["mfu_note"]
    assert cpu["flops_per_token"] == on_gpu["flops_per_token"]
    lora = mfu_fields(5e4, config, _run(lora=True, lora_r=8), "fp32", "NVIDIA L40S", 1)
    assert lora["flops_per_token"] < flops and lora["mfu_note"] == "1 GPU x l40s, 91.6 fp32 TFLOPs"
    unknown = mfu_fields(5e4, config, _run(), "bf16", "NVIDIA GH200 480GB", 1)
    assert unknown["mfu"] is None and "has no preset" in unknown["mfu_note"]
    classifier = mfu_fields(5e4, config, _run(task="classification"), "bf16", "NVIDIA H200", 1)
    assert classifier["mfu"] is None and "causal LMs only" in classifier["mfu_note"]


def test_the_last_line_shows_tokens_per_s_and_mfu_on_cuda_only():
    steps = [{"step": 1, "loss": 5.0, "tokens_per_s": 900.0}, {"step": 2, "loss": 4.0, "tokens_per_s": 1100.0}]
    summary = {"first_loss": 5.0, "last_loss": 4.0, "eval_loss": None, "tokens_per_s": 1000.0, "seconds": 3.0}
    cpu = table(steps, {**summary, "gpu": None, "mfu": None, "mfu_note": "no CUDA device"}).splitlines()[-1]
    assert cpu == "loss 5.000 -> 4.000, 1000 tokens/s, 3 s"
    gpu = table(steps, {**summary, "gpu": "NVIDIA H200", "mfu": 0.4123, "mfu_note": "1 GPU x h200, 989 bf16 TFLOPs"})
    assert gpu.splitlines()[-1] == "loss 5.000 -> 4.000, 1000 tokens/s, MFU 41.2% (1 GPU x h200, 989 bf16 TFLOPs), 3 s"
    unknown = table(steps, {**summary, "gpu": "NVIDIA GH200", "mfu": None, "mfu_note": "'NVIDIA GH200' has no preset"})
    assert ", MFU - ('NVIDIA GH200' has no preset), 3 s" in unknown
    assert table(steps, summary).splitlines()[-1] == cpu  # a summary from before MFU was recorded
