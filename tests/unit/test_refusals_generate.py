"""`dstk generate-config` refuses what its own `validate` (or DeepSpeed) would reject: one line naming
the flag, a non-zero exit, no traceback, no file written; and its --help promises only what it accepts."""

import json

import pytest

from tests.invoke import dstk
from toolkit.config import options as opts
from toolkit.config.generate import build_config
from toolkit.config.options import GenerateOptions

HUGE = "100000000000000000000000"


def refused(tmp_path, *args, code=1):
    """Run generate-config -o FILE in an empty folder; check the refusal; return stderr."""
    out = tmp_path / "ds.json"
    result = dstk("generate-config", *args, "-o", str(out), cwd=tmp_path)
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp file
    return result.stderr


@pytest.mark.parametrize("args,needle", [
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "-1e-4"], "--lr must be > 0, got -0.0001"),
    (["--eps", "nan"], "--eps must be a finite number"),
    (["--eps", "-1e-8"], "--eps must be >= 0, got -1e-08"),
    (["--grad-clip", "inf"], "--grad-clip (0 = off) must be a finite number, got inf"),
    (["--grad-clip", "-1"], "--grad-clip (0 = off) must be >= 0, got -1"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--momentum", "-inf", "--optimizer", "SGD"], "--momentum must be a finite number"),
    (["--warmup-min-lr", "-1"], "--warmup-min-lr must be >= 0"),
    (["--mbs", HUGE], f"--mbs {HUGE} is more than any real run uses (at most 2147483647)"),
    (["--gas", HUGE], f"--gas {HUGE} is more than any real run uses"),
    (["--world-size", "1000000000000", "--pp", "3"], "--world-size 1000000000000 is more processes than any cluster"),
    (["--nodes", "100000", "--gpus-per-node", "100000"], "= 10000000000 processes is more than any cluster"),
    (["--mbs", "2000000000", "--gas", "2000000000"], "gbs(4000000000000000000) is more than any real run uses"),
    (["--total-steps", HUGE, "--scheduler", "WarmupDecayLR"], f"--total-steps {HUGE} is more than"),
    (["--fp16", "--min-loss-scale", "0"], "--min-loss-scale must be > 0, got 0"),
    (["--fp16", "--loss-scale", "nan"], "--loss-scale (0 = dynamic) must be a finite number"),
    (["--fp16", "--initial-scale-power", "500"], "--initial-scale-power 500 is too large: 2**128 overflows fp32"),
    (["--scheduler", "WarmupCosineLR", "--total-steps", "10", "--warmup-min-lr", "0.1"],
     "--warmup-min-lr 0.1 exceeds --lr 0.0001"),
    (["--scheduler", "LRRangeTest"], "--scheduler LRRangeTest needs --warmup-steps >= 1"),
])
def test_bad_numbers_are_refused_naming_the_flag(tmp_path, args, needle):
    err = refused(tmp_path, *args)
    assert err.startswith("error: ") and needle in err, err


def test_every_bad_number_is_listed_at_once(tmp_path):
    err = refused(tmp_path, "--lr", "nan", "--eps", "-1", "--grad-clip", "inf", "--weight-decay", "nan")
    assert "4 problem(s)" in err
    for flag in ("--lr", "--eps", "--grad-clip", "--weight-decay"):
        assert f"  - {flag}" in err


def test_a_float_where_an_integer_belongs_is_a_usage_error(tmp_path):
    err = refused(tmp_path, "--mbs", "1e23", code=2)
    assert "'--mbs'" in err and "1e23" in err


@pytest.mark.parametrize("args,named", [
    (["--precision", "fp32", "--bf16"], ["--precision fp32", "--bf16"]),
    (["--precision", "fp16", "--bf16"], ["--precision fp16", "--bf16", "DeepSpeed asserts"]),
    (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
])
def test_conflicting_precision_flags_are_both_named(tmp_path, args, named):
    err = refused(tmp_path, *args, code=2)
    assert "ask for different precisions" in err and all(n in err for n in named), err


def test_one_precision_asked_twice_is_fine():
    result = dstk("generate-config", "--precision", "bf16", "--bf16")
    assert result.returncode == 0 and json.loads(result.stdout)["bf16"] == {"enabled": True}


def test_scheduler_choices_are_deepspeeds():
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    assert set(opts.SCHEDULERS) - {"none"} == set(VALID_LR_SCHEDULES)


@pytest.mark.parametrize("name", [s for s in opts.SCHEDULERS if s != "none"])
def test_every_scheduler_is_accepted_in_any_case_and_validates(tmp_path, name):
    from toolkit.cli.validate import check_file

    out = tmp_path / "ds.json"
    result = dstk("generate-config", "--scheduler", name.lower(), "--warmup-steps", "10", "--total-steps", "100",
                  "-o", str(out))
    assert result.returncode == 0, result.stderr
    cfg = json.loads(out.read_text())
    assert cfg["scheduler"]["type"] == name  # DeepSpeed's own spelling: it compares case-sensitively
    assert [p for p in check_file(str(out), 1)["problems"] if p["severity"] == "error"] == []


def test_lr_range_test_parameters():
    cfg = build_config(GenerateOptions(scheduler="LRRangeTest", lr=1e-5, warmup_steps=50))
    assert cfg["scheduler"] == {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 50, "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False}}


@pytest.mark.parametrize("name", [o for o in opts.OPTIMIZERS])
def test_every_optimizer_the_help_lists_is_accepted(name):
    result = dstk("generate-config", "--optimizer", name.lower())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout).get("optimizer", {"type": "none"})["type"] == name


def test_help_promises_only_what_the_flags_accept():
    text = " ".join(dstk("generate-config", "--help").stdout.split())  # unwrap the help's lines
    for copied in ("case-sensitive", "null", "is offload to", "launching path", "output_path", "Supported options"):
        assert copied not in text, copied
    assert "For Lion, Muon or a torch.optim class, edit the written config" in text
    for name in opts.OPTIMIZERS + opts.SCHEDULERS:
        assert name.lower() in text.lower()
