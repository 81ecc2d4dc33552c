"""bf16 gradient accumulation (issue 31, item 3): `dstk generate-config --bf16` writes ZeRO-1 with
"data_types": {"grad_accum_dtype": "fp32"} (DeepSpeed sums gradients in fp32 only at ZeRO >= 1);
`dstk validate` warns where bf16 sums them in bf16, and `dstk validate` / `dstk train` refuse an
accumulation dtype DeepSpeed refuses at ZeRO-0 (NotImplementedError in deepspeed.initialize), naming the
key and the fix, before anything is built."""

import json

import pytest

from tests.invoke import invoke_dstk
from tests.unit.test_train_refusals import GOOD_CONFIG, refused, train_cli
from toolkit.config.rules.accumulation import accumulation_problems, weights_dtype
from toolkit.config.generate import build_config
from toolkit.config.options import GenerateOptions

BF16 = {"bf16": {"enabled": True}}
FP32_SUMS = {"data_types": {"grad_accum_dtype": "fp32"}}


@pytest.mark.parametrize("options, stage, accum", [
    (dict(strategy="pp", pp=4, mbs=2, gbs=32, precision="bf16"), 1, "fp32"),  # the pp4.json preset
    (dict(strategy="dp", world_size=8, mbs=2, gbs=64, precision="bf16"), 1, "fp32"),
    (dict(strategy="dp", world_size=8, mbs=2, gbs=64, precision="bf16", zero=3), 3, "fp32"),
    (dict(strategy="pp", pp=4, mbs=2, gbs=32, precision="bf16", zero=0), 0, None),  # asked for: bf16 sums
    (dict(strategy="pp", pp=4, mbs=2, gbs=32), 0, None),  # fp32: ZeRO-0 as before
    (dict(strategy="dp", world_size=8, mbs=2, gbs=64, precision="fp16"), 0, None),
])
def test_bf16_defaults_to_zero1_with_fp32_accumulation(options, stage, accum):
    cfg = build_config(GenerateOptions(**options))
    assert cfg["zero_optimization"]["stage"] == stage
    assert (cfg.get("data_types") or {}).get("grad_accum_dtype") == accum


def test_generate_config_says_when_bf16_sums_in_bf16(tmp_path):
    asked = invoke_dstk(["generate-config", "--strategy", "pp", "--pp", "2", "--mbs", "2", "--gbs", "8", "--bf16",
                         "--zero", "0"])
    default = invoke_dstk(["generate-config", "--strategy", "pp", "--pp", "2", "--mbs", "2", "--gbs", "8", "--bf16"])
    assert asked.returncode == default.returncode == 0
    assert "warning: $.data_types.grad_accum_dtype: bf16 weights" in asked.stderr and default.stderr == ""
    assert json.loads(default.stdout)["data_types"] == {"grad_accum_dtype": "fp32"}


@pytest.mark.parametrize("cfg, want", [
    ({**BF16}, ("warning", 'use "zero_optimization": {"stage": 1} with "data_types": {"grad_accum_dtype": "fp32"}')),
    ({**BF16, "zero_optimization": {"stage": 2}}, ("warning", 'add "data_types": {"grad_accum_dtype": "fp32"}')),
    ({**BF16, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "bf16"}}, ("warning", '"bf16"')),
    ({**BF16, "zero_optimization": {"stage": 1}, **FP32_SUMS}, None),
    ({**BF16, "zero_optimization": {"stage": 3}, **FP32_SUMS}, None),
    ({**BF16, **FP32_SUMS}, ("error", "NotImplementedError")),  # stage 0 by default
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}, **FP32_SUMS}, ("error", "with fp16 weights")),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, ("error", "with fp32 weights")),
    ({**BF16, "zero_optimization": {"stage": 1, "compute_grad_norm": False}, **FP32_SUMS}, ("error", "ValueError")),
    ({"bfloat16": {"enabled": True}}, ("warning", "bf16 weights")),  # the legacy name
    ({"bf16": {"enabled": "auto"}}, None),  # the HF Trainer decides
    ({}, None),
])
def test_accumulation_rules(cfg, want):
    problems = accumulation_problems(cfg)
    assert [(p.severity, want[1] in p.message) for p in problems] == ([] if want is None else [(want[0], True)])
    assert all(p.path in ("$.data_types.grad_accum_dtype", "$.zero_optimization.compute_grad_norm") for p in problems)


def test_weights_dtype_reads_bf16_before_its_legacy_name():
    assert weights_dtype({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}) == "fp32"
    assert weights_dtype({"fp16": {"enabled": True}}) == "fp16" and weights_dtype({"fp16": {"enabled": "auto"}}) is None


def test_validate_refuses_fp32_sums_at_zero0(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **BF16, **FP32_SUMS}))
    result = invoke_dstk(["validate", str(path)])
    assert result.returncode == 1 and "error: $.data_types.grad_accum_dtype" in result.stdout + result.stderr


def test_train_refuses_fp32_sums_at_zero0_before_anything_is_built(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**GOOD_CONFIG, **BF16, **FP32_SUMS}))
    refused(train_cli(tmp_path, config=config), 1, "$.data_types.grad_accum_dtype", '"stage": 1')
    assert not (tmp_path / "run").exists()
