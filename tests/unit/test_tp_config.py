"""Tensor parallelism (DeepSpeed AutoTP) in configs: `generate-config --tp`, the `validate` rules for
tp > 1, and the model checks of `validate --model` (toolkit.config.rules.tensor_parallel, toolkit.plan.tp)."""

import json

import pytest

from toolkit.cli import main
from toolkit.config.generate import build_config
from toolkit.config.options import GenerateOptions
from toolkit.config.rules import check_rules
from toolkit.config.validate import check_schema
from toolkit.errors import ConfigError
from toolkit.plan.arch import load_arch
from toolkit.plan.tp import DEEPSPEED_PRESETS, HF_PLAN_TYPES, PLAN_SINCE, autotp_problems, has_hf_plan
from toolkit.distributed.topology import tp_of


def dstk(capsys, *argv):
    """(exit code, stdout, stderr) of `dstk ARGV` run in this process."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def tp_config(tp=2, **changes) -> dict:
    cfg = build_config(GenerateOptions(world_size=8, tp=tp, mbs=2, gbs=32, cpu=True))
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("cfg,tp", [({}, 1), ({"tensor_parallel": {}}, 1), ({"tensor_parallel": {"autotp_size": 0}}, 1),
                                    ({"tensor_parallel": {"autotp_size": 1}}, 1),
                                    ({"tensor_parallel": {"autotp_size": 4}}, 4)])
def test_tp_of_reads_autotp_size(cfg, tp):
    assert tp_of(cfg) == tp


@pytest.mark.parametrize("value", [-1, "2", True, 2.0])
def test_tp_of_refuses_values_deepspeed_cannot_use(value):
    with pytest.raises(ConfigError, match="autotp_size"):
        tp_of({"tensor_parallel": {"autotp_size": value}})


def test_generate_tp_writes_autotp_size_and_no_train_batch_size():
    cfg = tp_config()
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert "train_batch_size" not in cfg  # DeepSpeed would check it against the world size
    # dp = 8 / 2 = 4; gas = gbs / (mbs * dp) = 32 / (2 * 4)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    assert check_schema(cfg) == [] and check_rules(cfg, world_size=8) == []


def test_generate_tp_1_is_unchanged():
    assert build_config(GenerateOptions(world_size=8, tp=1, mbs=2, gbs=32)) == \
        build_config(GenerateOptions(world_size=8, mbs=2, gbs=32))


class WorldSize:
    """What DeepSpeedConfig asks an mpu for. Under AutoTP DeepSpeed parses the config with no mpu, so
    its "data-parallel" size is the whole world (runtime/config.py:456-471)."""

    def __init__(self, n):
        self.n = n

    def get_data_parallel_world_size(self):
        return self.n


def test_deepspeed_parses_generated_tp_config_at_the_world_size(ds_world1):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = tp_config(zero_optimization={"stage": 1})
    parsed = DeepSpeedConfig(cfg, mpu=WorldSize(8))
    assert parsed.tensor_parallel_config.autotp_size == 2
    assert parsed.train_micro_batch_size_per_gpu == 2 and parsed.gradient_accumulation_steps == 4
    assert parsed.train_batch_size == 2 * 4 * 8  # a label only: it counts the tp ranks as replicas
    with pytest.raises(AssertionError, match="32 != 2 \\* 4 \\* 8"):  # why generate leaves it out
        DeepSpeedConfig({**cfg, "train_batch_size": 32}, mpu=WorldSize(8))


@pytest.mark.parametrize("args,needle", [
    (["--world-size", "8", "--tp", "2", "--pp", "2", "--zero", "2"], "--zero 2 with pp=2"),
    (["--world-size", "6", "--tp", "4"], "world size 6 is not divisible by pp(1) * tp(4) = 4"),
    (["--world-size", "8", "--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--world-size", "8", "--tp", "2", "--gbs", "6"], "global batch 6 is not divisible by mbs(1) * dp(4) = 4"),
])
def test_generate_tp_refusals(capsys, tmp_path, args, needle):
    code, out, err = dstk(capsys, "generate-config", *args, "-o", str(tmp_path / "ds.json"))
    assert code == 1 and out == "" and needle in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def _validate(capsys, tmp_path, cfg, *args):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return dstk(capsys, "validate", str(path), *args)


@pytest.mark.parametrize("changes,args,needles", [
    ({"train_batch_size": 32}, ["--world-size", "8"],
     ['"train_batch_size" 32 with "autotp_size" 2', "runtime/config.py:471", 'remove "train_batch_size"',
      "dstk computes gbs = mbs * gas * dp"]),
    ({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}}, ["--world-size", "8"],
     ["stage"]),
    ({"pipeline": {"stages": 2}}, ["--world-size", "8"], []),  # 3D: dstk train shards the stages itself
    ({"zero_optimization": {"stage": 3}}, ["--world-size", "8"], []),  # AutoTP + ZeRO-3 trains and exports
    ({}, ["--world-size", "6", "--pp", "2"], ["world size 6 is not divisible by pp(2) * tp(2) = 4"]),
    ({"tensor_parallel": {"autotp_size": -1}}, [], ["autotp_size\" must be an integer >= 0"]),
    ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}}, [],
     ['"tp_size" 4 != "autotp_size" 2', "engine.py:1020-1022"]),
    ({"gradient_accumulation_steps": 3}, ["--world-size", "8"], []),  # gbs is derived: nothing to refuse
])
def test_validate_tp_refusals(capsys, tmp_path, changes, args, needles):
    code, out, err = _validate(capsys, tmp_path, tp_config(**changes), *args)
    assert code == (1 if needles else 0), out + err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def test_validate_tp_batch_fix_shows_the_gas_to_write(capsys, tmp_path):
    code, _, err = _validate(capsys, tmp_path, tp_config(train_batch_size=64), "--world-size", "8")
    assert code == 1 and '"gradient_accumulation_steps": 8 (gbs 64 = mbs(2) * gas(8) * dp(4))' in err, err


def test_validate_tp_offload_is_a_note_not_an_error(capsys, tmp_path):
    cfg = tp_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    code, out, err = _validate(capsys, tmp_path, cfg, "--world-size", "8")
    assert code == 0 and "dstk has not tested the combination" in out, out + err


def test_validate_dp_uses_tp():
    """dp = world / (pp * tp): the fix for a train_batch_size names dp = 8 / 2 = 4; with tp there is no
    train_batch_size, so mbs and gas alone fit any world that pp * tp divides."""
    cfg = tp_config()
    assert check_rules(cfg, world_size=8) == [] and check_rules(cfg, world_size=2) == []
    assert [p.path for p in check_rules(cfg, world_size=7)] == ["$.tensor_parallel.autotp_size"]


@pytest.mark.parametrize("model,tp,needle", [
    ("gpt2", 2, "has no AutoTP plan"),
    ("bert-base", 2, "auto_tp.py:349"),
    ("qwen2.5-0.5b", 4, "tp 4 does not divide qwen2.5-0.5b's num_attention_heads (14)"),
    ("tiny-llama", 4, "tp 4 does not divide tiny-llama's num_key_value_heads (2)"),
    ("llama-2-7b", 2, None),
    ("mistral-7b", 8, None),
])
def test_validate_model_rules(capsys, tmp_path, model, tp, needle):
    code, out, err = _validate(capsys, tmp_path, tp_config(tp=tp), "--world-size", "8", "--model", model)
    assert code == (1 if needle else 0), out + err
    if needle:
        assert needle in err and "Traceback" not in err, err


def test_intermediate_size_must_divide():
    arch = load_arch("tiny-llama")  # intermediate 176 = 16 * 11
    assert any("intermediate_size (176)" in p for p in autotp_problems(arch, 32))


def test_a_deepspeed_preset_needs_preset_model(capsys, tmp_path):
    model = tmp_path / "bloomish"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "bloom", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 128}))
    code, _, err = _validate(capsys, tmp_path, tp_config(), "--model", str(model))
    assert code == 1 and '"preset_model": "bloom"' in err, err
    cfg = tp_config(tensor_parallel={"autotp_size": 2, "preset_model": "bloom"})
    code, out, err = _validate(capsys, tmp_path, cfg, "--model", str(model))
    assert code == 0, out + err


def test_unknown_model_is_a_usage_error(capsys, tmp_path):
    code, _, err = _validate(capsys, tmp_path, tp_config(), "--model", "nosuch")
    assert code == 2 and "--model" in err and "Traceback" not in err


def test_hf_plan_table_matches_transformers():
    """HF_PLAN_TYPES: each has a base_model_tp_plan in the installed transformers, except those whose plan
    came in a later release (PLAN_SINCE), which has_hf_plan says for this release; gpt2, bert and opt have
    none (so AutoTP's heuristic refuses them)."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def has_plan(model_type):
        return bool(getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None))

    assert [t for t in sorted(HF_PLAN_TYPES) if has_hf_plan(t) != has_plan(t)] == []
    assert set(PLAN_SINCE) <= HF_PLAN_TYPES
    assert [t for t in ("gpt2", "bert", "opt") if has_plan(t)] == []
    assert not {"gpt2", "bert", "opt"} & set(DEEPSPEED_PRESETS)


def test_schema_knows_the_tensor_parallel_keys():
    cfg = tp_config(tensor_parallel={"autotp_size": 2, "vocab_parallel_lm_head": False, "preset_model": "llama"})
    assert check_schema(cfg) == []
    bad = check_schema(tp_config(tensor_parallel={"autotp_sise": 2}))
    assert any('did you mean "autotp_size"' in p.message for p in bad), bad
