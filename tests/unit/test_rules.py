"""Cross-field rules on config dicts, for a given world size and stage count."""

import pytest

from toolkit.config.problems import ERROR, NOTE
from toolkit.config.rules import check_rules

BASE = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 16,
        "pipeline": {"stages": 4}}


def errors(problems):
    return [p for p in problems if p.severity == ERROR]


def test_consistent_config_has_no_problems():
    assert check_rules(BASE, world_size=8) == []


def test_batch_mismatch_shows_arithmetic():
    [p] = errors(check_rules(BASE, world_size=16))
    assert p.path == "$.train_batch_size"
    assert "64 != \"train_micro_batch_size_per_gpu\"(2) * \"gradient_accumulation_steps\"(16) * dp(4) = 128" in p.message


def test_world_not_divisible_by_stages():
    [p] = errors(check_rules(BASE, world_size=6))
    assert "world size 6 is not divisible by pp 4" in p.message


def test_pp_flag_disagreeing_with_file_is_another_topology():
    p = errors(check_rules(BASE, world_size=8, pp=2))[0]
    assert p.path == "$.pipeline.stages" and "another topology" in p.message


def test_without_world_size_names_the_fitting_world():
    [p] = check_rules(BASE)
    assert p.severity == NOTE and "world size = dp(2) * pp(4) = 8" in p.message


def test_without_world_size_and_gas_lists_candidates():
    [p] = check_rules({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})
    assert "fit world sizes 1, 2, 4" in p.message


def test_zero2_with_pipeline_refused():
    cfg = dict(BASE, zero_optimization={"stage": 2})
    [p] = errors(check_rules(cfg, world_size=8))
    assert p.path == "$.zero_optimization.stage" and "PipelineEngine refuses" in p.message


def test_offload_rules():
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme"},
                                                        "offload_param": {"device": "cpu"}}}
    messages = [p.message for p in errors(check_rules(cfg, world_size=2))]
    assert any('"offload_optimizer" to nvme needs "stage" >= 1' in m for m in messages)
    assert any('"offload_param" to cpu needs "stage" >= 3' in m for m in messages)
    assert any('needs "nvme_path"' in m for m in messages)


def test_fp16_and_bf16_exclusive():
    cfg = {"train_batch_size": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
    assert any("exclusive" in p.message for p in errors(check_rules(cfg, world_size=2)))


def test_parts_must_match_stages():
    cfg = dict(BASE, pipeline={"stages": 4, "parts": [0, 3, 5, 9]})
    [p] = errors(check_rules(cfg, world_size=8))
    assert p.path == "$.pipeline.parts" and "4 stages need 5" in p.message


def test_auto_batch_is_left_to_the_trainer():
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    assert check_rules(cfg, world_size=8) == []


@pytest.mark.parametrize("optimizer, offload, noted", [
    ({"type": "AdamW", "params": {"lr": 1e-4}}, None, "$.optimizer.params"),  # FusedAdam: JIT-built
    ({"type": "Adam", "params": {"torch_adam": False}}, None, "$.optimizer.params"),
    ({"type": "Lamb", "params": {}}, None, "$.optimizer.type"),
    ({"type": "AdamW", "params": {"torch_adam": True, "fused": True}}, None, None),  # generate-config's default
    ({"type": "AdamW", "params": {}}, "cpu", None),  # offload: DeepSpeedCPUAdam, the reason to offload
])
def test_optimizers_deepspeed_jit_builds_get_a_note(optimizer, offload, noted):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "optimizer": optimizer,
           "zero_optimization": {"stage": 2, **({"offload_optimizer": {"device": offload}} if offload else {})}}
    notes = [p for p in check_rules(cfg, world_size=2) if "compiled at the first run" in p.message]
    assert [p.path for p in notes] == ([noted] if noted else []) and all(p.severity == NOTE for p in notes)
