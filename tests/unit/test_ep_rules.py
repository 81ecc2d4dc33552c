"""Expert parallelism (DeepSpeed AutoEP) in configs: `generate-config --ep`, the `validate` rules
(toolkit.config.rules.expert_parallel) and `validate --model`. DeepSpeed is the oracle: each layout dstk refuses
for the section alone, DeepSpeed's own pure checks (validate_autoep_config, run before any process group) refuse
too, and each it accepts they accept."""

import json

import pytest

from toolkit.cli import main
from toolkit.config.generate import build_config
from toolkit.config.options import GenerateOptions
from toolkit.config.rules import check_rules
from toolkit.config.rules.expert_parallel import PRESETS, model_problems
from toolkit.config.validate import check_schema
from toolkit.distributed.topology import ep_of
from toolkit.errors import ConfigError
from toolkit.plan.arch import load_arch


def dstk(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def ep_config(ep=2, world=4, zero=1, **changes) -> dict:
    cfg = build_config(GenerateOptions(world_size=world, ep=ep, ep_preset="mixtral", mbs=1, gas=1, zero=zero, cpu=True))
    for key, value in changes.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def errors(cfg, world, pp=None) -> list:
    return [p for p in check_rules(cfg, world_size=world, pp=pp) if p.severity == "error"]


def deepspeed_refuses(cfg: dict, world: int, pp: int = 1) -> bool:
    """Whether DeepSpeed 0.19.8's own AutoEP checks (auto_ep_config.validate_autoep_config, which runs
    auto_ep_folding's) raise for `cfg` on `world` ranks at `pp` stages."""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

    zero = cfg.get("zero_optimization", {})
    try:
        validate_autoep_config(parse_autoep_config(cfg["expert_parallel"]), world, pp,
                               cfg.get("tensor_parallel", {}).get("autotp_size", 1), cfg.get("sequence_parallel_size", 1),
                               zero_stage=zero.get("stage", 0), zero_offload_optimizer="offload_optimizer" in zero,
                               zero_offload_param="offload_param" in zero)
    except ValueError:
        return True
    return False


def test_generate_ep_writes_deepspeeds_section_and_the_schema_takes_it():
    cfg = ep_config()
    assert cfg["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    assert cfg["train_batch_size"] == 4  # ep lies inside dp: dp stays world / pp
    assert check_schema(cfg) == [] and errors(cfg, 4) == []
    assert "expert_parallel" not in build_config(GenerateOptions(world_size=4, mbs=1, gas=1))


@pytest.mark.parametrize("cfg,ep", [({}, 1), ({"expert_parallel": {"autoep_size": 4}}, 1),
                                    ({"expert_parallel": {"enabled": True}}, 1),
                                    ({"expert_parallel": {"enabled": True, "autoep_size": 4}}, 4)])
def test_ep_of_reads_an_enabled_section_only(cfg, ep):
    assert ep_of(cfg) == ep


@pytest.mark.parametrize("value", [0, "2", True, 2.0])
def test_ep_of_refuses_values_deepspeed_cannot_use(value):
    with pytest.raises(ConfigError, match="autoep_size"):
        ep_of({"expert_parallel": {"enabled": True, "autoep_size": value}})


ACCEPTED = {  # world, pp, changes: layouts DeepSpeed's AutoEP takes
    "dp4_ep2": (4, 1, {}), "dp4_ep4": (4, 1, {"expert_parallel": {"autoep_size": 4}}),
    "zero3": (4, 1, {"zero_optimization": {"stage": 3}}),
    "zero2_offload": (4, 1, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    "pp2": (4, 2, {}), "tp2_ep2": (4, 1, {"tensor_parallel": {"autotp_size": 2}}),
}
REFUSED = {  # world, pp, changes, the JSON path dstk names, words of its message
    "ep_over_stage": (6, 1, {"expert_parallel": {"autoep_size": 4}}, "$.expert_parallel.autoep_size",
                      "world(6) / pp(1) = 6"),
    "ep_over_pipeline_stage": (4, 2, {"expert_parallel": {"autoep_size": 4}}, "$.expert_parallel.autoep_size",
                               "world(4) / pp(2) = 2"),
    "etp": (4, 1, {"expert_parallel": {"expert_tensor_parallel_size": 2}},
            "$.expert_parallel.expert_tensor_parallel_size", "anything but 1"),
    "tp_ep1": (4, 1, {"expert_parallel": {"autoep_size": 1}, "tensor_parallel": {"autotp_size": 2}},
               "$.expert_parallel.autoep_size", '"autoep_size" 1 with "autotp_size" 2'),
    "tp_pp2": (8, 2, {"tensor_parallel": {"autotp_size": 2}},
               "$.expert_parallel.autoep_size", "pp 2 with"),
    "tp_offload": (4, 1, {"tensor_parallel": {"autotp_size": 2},
                          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                   "$.zero_optimization.offload_optimizer", "refuses ZeRO offload"),
    "tp_async": (4, 1, {"tensor_parallel": {"autotp_size": 2},
                        "expert_parallel": {"async_split_plan": True}}, "$.expert_parallel.async_split_plan",
                 "auto_ep_config.py:133"),
    "load_balance": (4, 1, {"expert_parallel": {"load_balance_coeff": 0.001}}, "$.expert_parallel.load_balance_coeff",
                     "set it to null"),
}


def _config(changes: dict) -> dict:
    """ep_config with `changes`, without train_batch_size (mbs and gas fit any dp; tp > 1 wants it out)."""
    cfg = ep_config(**changes)
    del cfg["train_batch_size"]
    return cfg


@pytest.mark.parametrize("name", ACCEPTED)
def test_layouts_deepspeed_accepts_dstk_accepts(name):
    world, pp, changes = ACCEPTED[name]
    cfg = _config(changes)
    if pp > 1:
        cfg["pipeline"]["stages"] = pp
    assert not deepspeed_refuses(cfg, world, pp)
    assert errors(cfg, world) == []


@pytest.mark.parametrize("name", REFUSED)
def test_layouts_deepspeed_refuses_dstk_refuses_with_the_key_and_numbers(name):
    world, pp, changes, path, words = REFUSED[name]
    cfg = _config(changes)
    cfg["pipeline"]["stages"] = pp
    assert deepspeed_refuses(cfg, world, pp)
    found = errors(cfg, world)
    assert [p.path for p in found] == [path], found
    assert words in found[0].message, found[0].message


@pytest.mark.parametrize("key,value", [("sequence_parallel_size", 2),
                                       ("zero_optimization", {"stage": 3, "zero_quantized_gradients": True}),
                                       ("zero_optimization", {"stage": 3, "zero_hpz_partition_size": 2})])
def test_zero3_combinations_the_engine_refuses_are_refused(key, value):
    """runtime/engine.py:2219-2227 (_validate_zero3_moe_compatibility), after the model is built."""
    cfg = ep_config(zero=3, **{key: value})
    cfg.pop("train_batch_size")
    assert any("ZeRO-3" in p.message for p in errors(cfg, 4)), errors(cfg, 4)


def test_zero0_clipping_with_experts_split_is_refused_and_generate_says_which_flags(capsys):
    """DeepSpeed takes it, but clips by the mean of the ranks' local norms (runtime/utils.py:413-418)."""
    cfg = ep_config(zero_optimization={"stage": 0})
    found = errors(cfg, 4)
    assert [p.path for p in found] == ["$.zero_optimization.stage"] and "wrong global norm" in found[0].message
    assert errors({**cfg, "gradient_clipping": 0.0}, 4) == [] and errors(ep_config(ep=1, zero=0), 4) == []
    assert errors(ep_config(zero_optimization={"stage": 3}), 4) == []
    code, _, err = dstk(capsys, "generate-config", "--world-size", "4", "--ep", "2", "--mbs", "1", "--gas", "1")
    assert code == 1 and "--zero 0 with --ep 2 and --grad-clip 1.0" in err and "use --zero 1" in err, err


def test_a_section_without_enabled_is_a_warning_not_a_layout():
    cfg = ep_config()
    del cfg["expert_parallel"]["enabled"]
    found = check_rules(cfg, world_size=4)
    assert [(p.path, p.severity) for p in found] == [("$.expert_parallel.enabled", "warning")], found


def test_the_schema_refuses_an_unknown_preset_and_a_fractional_size():
    paths = {p.path for p in check_schema(ep_config(expert_parallel={"preset_model": "mixtrall", "autoep_size": 1.5}))}
    assert {"$.expert_parallel.preset_model", "$.expert_parallel.autoep_size"} <= paths, paths


def test_presets_are_deepspeeds():
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    assert PRESETS == {name: tuple(p.hf_model_types) for name, p in PRESET_MODELS.items()}


def test_model_checks_name_the_preset_and_the_experts():
    mixtral = load_arch("tiny-mixtral")  # 4 experts
    assert model_problems(ep_config(ep=4, world=4), mixtral) == []
    wrong = model_problems(ep_config(expert_parallel={"preset_model": "qwen3_moe", "autoep_size": 3}, world=6), mixtral)
    assert [p.path for p in wrong] == ["$.expert_parallel.preset_model", "$.expert_parallel.autoep_size"]
    assert 'use "preset_model": "mixtral"' in wrong[0].message
    assert "4 experts" in wrong[1].message and "one of 1, 2, 4" in wrong[1].message
    dense = model_problems(ep_config(), load_arch("tiny-llama"))
    assert [p.path for p in dense] == ["$.expert_parallel.enabled"] and "no experts" in dense[0].message


def test_validate_with_a_model_and_generate_config_refuse_in_one_line(capsys, tmp_path):
    path = tmp_path / "ep.json"
    path.write_text(json.dumps(ep_config(expert_parallel={"autoep_size": 4}, world=8)))
    code, _, err = dstk(capsys, "validate", str(path), "--world-size", "8", "--model", "tiny-mixtral")
    assert code == 0, err
    path.write_text(json.dumps(ep_config(expert_parallel={"autoep_size": 8}, world=8)))
    code, _, err = dstk(capsys, "validate", str(path), "--world-size", "8", "--model", "tiny-mixtral")
    assert code == 1 and '"autoep_size" 8 does not divide tiny-mixtral\'s 4 experts' in err, err
    code, _, err = dstk(capsys, "generate-config", "--world-size", "6", "--ep", "4", "--mbs", "1", "--gas", "1")
    assert code == 1 and "--ep 4 does not divide the ranks of a stage: world(6) / pp(1) = 6" in err, err
    assert "Traceback" not in err


def test_validate_says_what_dstk_train_does_not_run_with_ep_yet(tmp_path):
    """ep with tp or sp: DeepSpeed may take the file, dstk train --check refuses it; validate says so (a warning)."""
    from toolkit.cli.validate import check_file

    for key, value in (("tensor_parallel", {"autotp_size": 2}), ("sequence_parallel_size", 2)):
        cfg = ep_config(ep=2, world=8)
        cfg[key] = value
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps(cfg))
        notes = [p for p in check_file(str(path), world_size=8)["problems"] if "dstk train refuses it" in p["message"]]
        assert len(notes) == 1 and notes[0]["severity"] == "warning", notes
