"""`dstk partition` as a user runs it: the table, --json, clean errors with non-zero exit, no torch."""

import json
import subprocess
import sys

import pytest


def dstk(*args):
    return subprocess.run([sys.executable, "-m", "toolkit.cli", "partition", *args], capture_output=True,
                          text=True, timeout=120)


def test_table_compares_with_deepspeed():
    result = dstk("gpt2", "--pp", "4", "--seq-len", "512")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "embed .. block.3" in out and "head" in out
    assert "dstk compute" in out and "deepspeed parameters" in out and "deepspeed uniform" in out
    assert "[0, 6, 6, 0]" in out  # DeepSpeed's default split of GPT-2 124M over 4 stages


def test_json_report_and_no_heavy_imports():
    from tests.conftest import run_cli_fresh

    result, heavy = run_cli_fresh(['partition', 'llama-3.2-1b', '--pp', '4', '--seq-len', '2048', '--json'])
    assert heavy == [], result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["num_layers"] == 16 + 3 and report["params"] == 1_235_814_400
    assert [s["method"] for s in report["splits"]] == ["compute", "parameters", "uniform"]
    assert sum(s["layers"] for s in report["stages"]) == 19
    dstk_split, ds_params = report["splits"][0], report["splits"][1]
    assert dstk_split["imbalance"] <= ds_params["imbalance"]
    assert sum(s["params"] for s in report["stages"]) >= report["params"]  # + the tied head's copy


@pytest.mark.parametrize("args, code, message", [
    (["gpt2", "--pp", "16"], 1, "--pp 16 is more stages than the model's 15 pipeline layers"),
    (["gpt-3", "--pp", "2"], 1, "unknown model 'gpt-3'"),
    (["./missing/model", "--pp", "2"], 2, "no such directory"),
    (["gpt2", "--pp", "2", "--method", "fastest"], 1, "--method 'fastest' is not one of"),
    (["gpt2", "--pp", "2", "--seq-len", "4096"], 1, "exceeds gpt2's max_positions (1024)"),
    (["gpt2", "--pp", "0"], 2, "Invalid value for '--pp'"),
])
def test_bad_input_exits_non_zero_without_traceback(args, code, message):
    result = dstk(*args)
    assert result.returncode == code
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_profile_method_times_the_real_layers():
    result = dstk("tiny-llama", "--pp", "2", "--seq-len", "32", "--method", "profile", "--reps", "1", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["balanced_by"] == "measured time"
    assert [s["method"] for s in report["splits"]] == ["profile", "parameters", "uniform"]
    assert report["splits"][0]["imbalance"] <= min(s["imbalance"] for s in report["splits"][1:]) + 1e-9


def test_lora_report_says_rank_and_trainable_count_and_imports_no_heavy_package():
    from tests.conftest import run_cli_fresh

    result, heavy = run_cli_fresh(['partition', 'llama-2-7b', '--pp', '4', '--seq-len', '1024', '--lora', '16',
                                   '--json'])
    assert heavy == [], result.stderr[-2000:]
    report = json.loads(result.stdout)
    adapters = 39_976_960  # Llama-2-7b, r=16 on all 7 projections (peft's count)
    assert report["lora_r"] == 16 and report["trainable_params"] == adapters
    assert report["params"] == 6_738_415_616 + adapters
    assert sum(s["trainable"] for s in report["stages"]) == adapters
    full = json.loads(dstk("llama-2-7b", "--pp", "4", "--seq-len", "1024", "--json").stdout)
    assert full["lora_r"] is None and full["trainable_params"] == full["params"] == 6_738_415_616
    for lora_stage, full_stage in zip(report["stages"], full["stages"]):  # a frozen base: weights only
        assert lora_stage["memory_bytes"] < 0.6 * full_stage["memory_bytes"]
        assert lora_stage["flops"] < 0.75 * full_stage["flops"]  # no weight gradients for the base
    text = dstk("llama-2-7b", "--pp", "4", "--lora", "16")
    assert text.returncode == 0 and "LoRA r=16 on every block linear: 40.0M trainable parameters" in text.stdout


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_lora_rank_is_one_line(value):
    result = dstk("gpt2", "--pp", "2", "--lora", value)
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: --lora must be a positive integer (the LoRA rank r), got {value}"
