"""`dstk train --check` (toolkit.train.runner.check, before any rank starts) refuses what dstk train does not
combine with DeepSpeed's AutoEP yet, each with its reason; a pp 1 run passes (its export too, ZeRO 0-3), and a pp 2
run with its export. The runs that train:
tests/distributed/test_expert_parallel.py."""

import json

import pytest

from toolkit.errors import ConfigError

EP = {"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}}


def check_with(tmp_path, changes: dict, world: int = 2, **flags):
    from tests.unit.test_launch import _args
    from toolkit.train.runner import check

    args = _args(tmp_path, 1, **{"export": False, "model": "tiny-mixtral", **flags})
    cfg = {**json.loads(open(args.config).read()), **EP, **changes}
    (tmp_path / "ep.json").write_text(json.dumps(cfg))
    args.config = str(tmp_path / "ep.json")
    check(args, world)


@pytest.mark.parametrize("changes,world", [({}, 2), ({"pipeline": {"stages": 2}}, 4)])
def test_ep_at_pp1_and_inside_pipeline_stages_without_export_passes_the_checks(tmp_path, changes, world):
    check_with(tmp_path, changes, world)


@pytest.mark.parametrize("model,ep,world,words", [
    ("tiny-gpt2", 2, 2, ["tiny-gpt2 (gpt2) has no experts", 'remove "expert_parallel"']),
    ("tiny-mixtral", 3, 3, ["\"autoep_size\" 3 does not divide tiny-mixtral's 4 experts", "one of 1, 2, 4"]),
])
def test_ep_against_the_model_is_refused_before_any_rank(tmp_path, model, ep, world, words):
    """What AutoEP raises on every rank after the launch (a model without experts; ep not dividing its experts),
    refused at --check from config.json alone, as `dstk validate --model` does."""
    with pytest.raises(ConfigError) as info:
        check_with(tmp_path, {"expert_parallel": {"enabled": True, "autoep_size": ep}}, world, model=model)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("zero", [1, 3])
def test_ep_at_pp1_passes_the_checks_with_its_export(tmp_path, zero):
    check_with(tmp_path, {"zero_optimization": {"stage": zero}}, export=True)  # the experts joined from their ep ranks


def test_ep_inside_pipeline_stages_passes_the_checks_with_its_export(tmp_path):
    check_with(tmp_path, {"pipeline": {"stages": 2}}, 4, export=True)  # each stage's experts joined by HF name


@pytest.mark.parametrize("changes,world,flags,words", [
    ({"pipeline": {"stages": 2}, "gradient_accumulation_steps": 4}, 4, {"schedule": "dualpipev"},
     "--schedule dualpipev with \"expert_parallel\""),
    ({"tensor_parallel": {"autotp_size": 2}}, 4, {}, '"autotp_size" 2 with "expert_parallel" (ep 2)'),
    ({"sequence_parallel_size": 2}, 4, {}, '"sequence_parallel_size" 2 with "expert_parallel" (ep 2)'),
    ({}, 2, {"lora": True}, "--lora with \"expert_parallel\" (ep 2): peft wraps the model"),
])
def test_what_dstk_train_cannot_combine_with_ep_yet_is_refused_with_its_reason(tmp_path, changes, world, flags, words):
    with pytest.raises(ConfigError) as refused:
        check_with(tmp_path, changes, world, **flags)
    assert words in str(refused.value), str(refused.value)


def test_zero0_with_clipping_is_refused_by_the_config_rules(tmp_path):
    with pytest.raises(ConfigError, match="clips by a wrong global norm"):
        check_with(tmp_path, {"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0})


BASE = {"model": "m", "pp": 1, "dp": 2, "tp": 1, "zero_stage": 1, "portable": True}


def resumable(tmp_path, saved: dict, now: dict):
    from toolkit.checkpoint.manifest import check_resumable

    (tmp_path / "dstk").mkdir(exist_ok=True)
    (tmp_path / "dstk" / "manifest.json").write_text(json.dumps({**BASE, **saved}))
    return check_resumable(tmp_path, {**BASE, **now})


@pytest.mark.parametrize("saved,now,words", [
    ({"expert_parallel": 2, "zero_stage": 0, "param_groups": [["model.layers.0.mlp.experts.gate_up_proj"]]},
     {"zero_stage": 0}, "names its optimizer's parameters as they were before AutoEP")])
def test_a_resume_onto_a_layout_the_move_cannot_fill_is_refused(tmp_path, saved, now, words):
    with pytest.raises(ConfigError, match=words):
        resumable(tmp_path, saved, now)
    assert resumable(tmp_path, saved, saved) == []  # the same layout: DeepSpeed's own load


@pytest.mark.parametrize("saved,now", [({"expert_parallel": 2}, {}), ({"expert_parallel": 2}, {"dp": 1}),
                                       ({"expert_parallel": 2}, {"dp": 4, "zero_stage": 2}),
                                       ({}, {"expert_parallel": 2}), ({"expert_parallel": 2}, {"expert_parallel": 4}),
                                       ({"expert_parallel": 2, "zero_stage": 0,  # AutoEP's names, recorded after initialize
                                         "param_groups": [["model.layers.0.mlp.experts.w1"]]}, {"zero_stage": 0}),
                                       ({"expert_parallel": 2, "zero_stage": 3}, {"zero_stage": 3}),
                                       ({"expert_parallel": 2, "pp": 2}, {"pp": 2, "dp": 4}),  # off ep in stages
                                       ({"expert_parallel": 2, "pp": 2, "zero_stage": 0}, {"zero_stage": 0}),
                                       ({"pp": 2}, {"expert_parallel": 2, "pp": 2, "dp": 4}),  # onto it
                                       ({}, {"expert_parallel": 2, "zero_stage": 3}),  # onto ZeRO-3 shares of it
                                       ({"expert_parallel": 2}, {"expert_parallel": 4, "dp": 4, "zero_stage": 3})])
def test_an_ep_run_moves_by_hf_name(tmp_path, saved, now):
    assert "expert_parallel" in resumable(tmp_path, saved, now)  # toolkit.checkpoint.portable
