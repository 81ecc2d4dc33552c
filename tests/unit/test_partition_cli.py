"""`dstk partition` as a user runs it: the table, --json, clean errors with non-zero exit (in this
process; its fast start, no torch, is tests/commands/test_start_up.py)."""

import json

import pytest

from tests.invoke import invoke_dstk


def dstk(*args):
    return invoke_dstk(["partition", *args])


def test_table_compares_with_deepspeed():
    result = dstk("gpt2", "--pp", "4", "--seq-len", "512")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "embed .. block.3" in out and "head" in out
    assert "dstk compute" in out and "deepspeed parameters" in out and "deepspeed uniform" in out
    assert "[0, 6, 6, 0]" in out  # DeepSpeed's default split of GPT-2 124M over 4 stages


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
    assert report["profiled_on"] == "timed on cpu in fp32"  # no CUDA here; on a GPU: cuda:N (name) in bf16
    table = dstk("tiny-llama", "--pp", "2", "--seq-len", "32", "--method", "profile", "--reps", "1")
    assert table.returncode == 0 and "slowest/mean stage by measured time (timed on cpu in fp32)" in table.stdout


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_lora_rank_is_one_line(value):
    result = dstk("gpt2", "--pp", "2", "--lora", value)
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: --lora must be a positive integer (the LoRA rank r), got {value}"


@pytest.mark.parametrize("precision_keys, given, want", [
    ({}, [], "seq 256 x mbs 4, fp32"),  # an fp32 file: not the command's bf16 default
    ({"bf16": {"enabled": True}}, [], "seq 256 x mbs 4, bf16"),
    ({"fp16": {"enabled": True}}, ["--mbs", "2"], "seq 256 x mbs 2, fp16"),  # the command line wins
    ({"bf16": {"enabled": "auto"}}, ["--precision", "fp32"], "seq 256 x mbs 4, fp32"),
])
def test_partition_with_a_config_reads_its_micro_batch_and_precision(tmp_path, precision_keys, given, want):
    """`dstk partition --config ds.json` once reported "mbs 1, bf16" for an fp32 mbs 4 file it records into."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                  "pipeline": {"stages": 2}, **precision_keys}))
    result = invoke_dstk(["partition", "tiny-gpt2", "--pp", "2", "--config", str(config), *given])
    assert result.returncode == 0, result.stderr
    assert want in result.stdout, result.stdout
    assert json.loads(config.read_text())["pipeline"]["parts"]  # recorded as before
