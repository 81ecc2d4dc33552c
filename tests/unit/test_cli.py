"""The `dstk` command end to end, as a user runs it: exit codes, messages, no tracebacks. In this
process, through the console entry point toolkit.cli.main and Click's CliRunner; what a fresh
process imports at start-up is checked in tests/commands/test_start_up.py."""

import json

import pytest

from tests.invoke import dstk


def test_help_lists_commands():
    result = dstk("--help")
    assert result.returncode == 0
    for command in ("generate-config", "validate", "schema"):
        assert command in result.stdout


def test_generate_then_validate_round_trip(tmp_path):
    out = tmp_path / "my.json"
    gen = dstk("generate-config", "--strategy", "hybrid", "--world-size", "8", "--pp", "4", "--mbs", "2", "--gbs", "64",
               "--zero", "1", "--bf16", "-o", str(out))
    assert gen.returncode == 0, gen.stderr
    cfg = json.loads(out.read_text())
    assert cfg["gradient_accumulation_steps"] == 16
    ok = dstk("validate", str(out), "--world-size", "8")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = dstk("validate", str(out), "--world-size", "16")
    assert bad.returncode == 1
    assert "dp(4) = 128" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_refusal_is_one_clean_message():
    result = dstk("generate-config", "--world-size", "8", "--pp", "3")
    assert result.returncode == 1
    assert result.stderr.startswith("error: world size 8 is not divisible by pp(3)")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_generate_refuses_to_overwrite(tmp_path):
    out = tmp_path / "ds.json"
    out.write_text("keep me")
    result = dstk("generate-config", "--world-size", "2", "-o", str(out))
    assert result.returncode == 1 and "--force" in result.stderr
    assert out.read_text() == "keep me"
    assert dstk("generate-config", "--world-size", "2", "-o", str(out), "--force").returncode == 0
    assert json.loads(out.read_text())["train_batch_size"] == 2


def test_validate_reports_every_problem_with_paths(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpus": 2,
                                "zero_optimization": {"stage": 3, "stag": 1}, "pipeline": {"stages": 2}}))
    result = dstk("validate", str(path), "--world-size", "4", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    paths = {p["path"] for p in report["files"][0]["problems"] if p["severity"] == "error"}
    assert "$.zero_optimization.stage" in paths  # ZeRO 3 with a pipeline
    assert any("train_micro_batch_size_per_gpus" in p for p in paths)
    assert any("stag" in p for p in paths if "zero_optimization" in p)
    messages = " ".join(p["message"] for p in report["files"][0]["problems"])
    assert "did you mean" in messages


@pytest.mark.parametrize("content,reason", [
    (None, "no such file"),
    (b"\x00\x01\x02\xff" * 10, ""),
    (b'{"train_batch_size": 8', ""),
    (b"[1, 2]", ""),
    (b'{"train_batch_size": NaN}', ""),
])
def test_validate_unusable_input_exits_2_without_traceback(tmp_path, content, reason):
    path = tmp_path / "in.json"
    if content is not None:
        path.write_bytes(content)
    result = dstk("validate", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and reason in result.stderr


def test_validate_directory_exits_2(tmp_path):
    result = dstk("validate", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_validate_auto_is_a_note_unless_strict(tmp_path):
    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}))
    assert dstk("validate", str(path)).returncode == 0
    strict = dstk("validate", str(path), "--strict")
    assert strict.returncode == 1 and "auto" in strict.stderr


def test_schema_command_prints_the_schema():
    result = dstk("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["$schema"].endswith("2020-12/schema")
    assert "zero_optimization" in schema["properties"]


def test_help_says_sp_works_inside_pipeline_stages(tmp_path):
    """reshard and generate-config once said sp was pp 1 only, though pp x sp trains (and both accept it)."""
    for command in ("reshard", "generate-config"):
        text = " ".join(dstk(command, "--help").stdout.split())
        assert "pp 1 only" not in text and "pp = 1, tp = 1" not in text, text
        assert "any --pp" in text, text
    made = dstk("generate-config", "--world-size", "4", "--pp", "2", "--sp", "2", "-o", str(tmp_path / "ds.json"))
    assert made.returncode == 0, made.stderr
    cfg = json.loads((tmp_path / "ds.json").read_text())
    assert cfg["pipeline"]["stages"] == 2 and cfg["sequence_parallel_size"] == 2
