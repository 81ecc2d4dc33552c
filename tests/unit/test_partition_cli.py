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
