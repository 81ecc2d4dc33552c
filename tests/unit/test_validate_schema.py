"""Schema validation: every problem, each with its JSON path and a message a person can act on."""

import pytest

from toolkit.config.problems import ERROR, NOTE, WARNING
from toolkit.config.validate import check_schema

CLEAN = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 16,
    "steps_per_print": 10, "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "none"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1, "torch_adam": True}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100}},
    "pipeline": {"stages": 4, "partition_method": "type:GPT2Block", "parts": [0, 3, 6, 9, 12],
                 "activation_checkpoint_interval": 1},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
    "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "x"},
    "checkpoint": {"tag_validation": "Warn"}, "data_types": {"grad_accum_dtype": "fp32"},
}


def _by_path(cfg, strict=False):
    return {p.path: p for p in check_schema(cfg, strict=strict)}


def test_clean_config_has_no_problems():
    assert check_schema(CLEAN) == []


@pytest.mark.parametrize("cfg, path, suggestion", [
    ({"zero_optimisation": {"stage": 1}}, "$.zero_optimisation", '"zero_optimization"'),
    ({"train_micro_batch_size_per_gpus": 2}, "$.train_micro_batch_size_per_gpus",
     '"train_micro_batch_size_per_gpu"'),
    ({"zero_optimization": {"stag": 2}}, "$.zero_optimization.stag", '"stage"'),
    ({"zero_optimization": {"offload_param": {"devic": "cpu"}}}, "$.zero_optimization.offload_param.devic", '"device"'),
    ({"activation_checkpointing": {"partition_activation": True}}, "$.activation_checkpointing.partition_activation",
     '"partition_activations"'),
    ({"pipeline": {"activation_checkpoint_intervall": 1}}, "$.pipeline.activation_checkpoint_intervall",
     '"activation_checkpoint_interval"'),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, "$.optimizer.params.weight_decy", '"weight_decay"'),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, "$.scheduler.params.warmup_num_step",
     '"warmup_num_steps"'),
])
def test_typos_are_flagged_with_a_suggestion_at_every_level(cfg, path, suggestion):
    problems = _by_path(cfg)
    assert path in problems, problems
    assert problems[path].severity == ERROR
    assert f"did you mean {suggestion}?" in problems[path].message


def test_a_key_at_the_wrong_level_says_where_it_belongs():
    problem = _by_path({"stage": 2})["$.stage"]
    assert 'belongs under "zero_optimization"' in problem.message
    assert "ignore it silently" in problem.message


def test_all_problems_are_reported_not_just_the_first():
    cfg = {"zero_optimisation": {}, "bf16": {"enabld": True}, "gradient_clipping": -1, "fp16": {"loss_scale": "x"}}
    assert set(_by_path(cfg)) == {"$.zero_optimisation", "$.bf16.enabld", "$.gradient_clipping", "$.fp16.loss_scale"}


@pytest.mark.parametrize("cfg, path, words", [
    ({"zero_optimization": {"stage": "2"}}, "$.zero_optimization.stage", ["string \"2\"", "write 2", "converts it"]),
    ({"bf16": {"enabled": "yes"}}, "$.bf16.enabled", ["write true", "converts it to true"]),
    ({"gradient_clipping": "1.0"}, "$.gradient_clipping", ["write 1.0", "keeps it a string"]),
    ({"activation_checkpointing": {"cpu_checkpointing": "false"}}, "$.activation_checkpointing.cpu_checkpointing",
     ["write false", "non-empty string as true"]),
])
def test_strings_deepspeed_would_coerce_are_flagged_with_what_it_would_do(cfg, path, words):
    problem = _by_path(cfg)[path]
    assert problem.severity == ERROR
    for word in words:
        assert word in problem.message, problem.message


def test_removed_keys_are_named_as_removed():
    problems = _by_path({"amp": {"enabled": True}, "elasticity": {}, "zero_optimization": {"mics_shard_size": 8}})
    for path in ("$.amp", "$.elasticity", "$.zero_optimization.mics_shard_size"):
        assert "removed in DeepSpeed 0.19" in problems[path].message
        assert "did you mean" not in problems[path].message


def test_deprecated_keys_are_warnings():
    problem = _by_path({"zero_optimization": {"stage": 2, "cpu_offload": True}})["$.zero_optimization.cpu_offload"]
    assert problem.severity == WARNING and "offload_optimizer" in problem.message


def test_auto_is_a_note_and_strict_makes_it_an_error():
    cfg = {"train_batch_size": "auto", "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW",
           "params": {"lr": "auto"}}}
    notes = _by_path(cfg)
    assert {p.severity for p in notes.values()} == {NOTE}
    assert set(notes) == {"$.train_batch_size", "$.bf16.enabled", "$.optimizer.params.lr"}
    assert "HF Trainer/Accelerate must fill" in notes["$.train_batch_size"].message
    strict = _by_path(cfg, strict=True)
    assert {p.severity for p in strict.values()} == {ERROR}


def test_auto_where_nobody_fills_it_is_an_error():
    problem = _by_path({"zero_optimization": {"overlap_comm": "auto"}})["$.zero_optimization.overlap_comm"]
    assert problem.severity == ERROR and "drops it silently" in problem.message


def test_values_out_of_range_show_the_bound_not_a_schema_dump():
    problems = _by_path({"zero_optimization": {"stage": 4, "offload_param": {"device": "CPU"}},
                         "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.999, 0.1]}},
                         "pipeline": {"stages": 0}})
    assert problems["$.zero_optimization.stage"].message == '"stage" is 4; expected one of 0, 1, 2, 3'
    assert 'did you mean "cpu"?' in problems["$.zero_optimization.offload_param.device"].message
    assert problems["$.optimizer.params.betas"].message == '"betas" has 3 items; expected 2 or fewer'
    assert problems["$.pipeline.stages"].message == '"stages" is 0; expected an integer >= 1 or "auto"'
    assert all("anyOf" not in p.message and "{'" not in p.message for p in problems.values())


def test_missing_required_keys():
    problems = _by_path({"optimizer": {"params": {"lr": 1e-3}},
                         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})
    assert problems["$.optimizer"].message == '"optimizer" needs the key "type"'
    assert 'needs the key "total_num_steps"' in problems["$.scheduler.params"].message


def test_keys_that_need_quoting_get_a_bracketed_path():
    assert "$[\"zero-optimization\"]" in _by_path({"zero-optimization": {"stage": 1}})


@pytest.mark.parametrize("name", ["AdamW", "adamw", "ADAMW", "Adamw", "lamb", "SGD", "RMSprop"])
def test_optimizer_types_deepspeed_accepts_pass(name):
    assert check_schema({"optimizer": {"type": name, "params": {"lr": 1e-3}}}) == []


def test_optimizer_type_typos_and_torch_case():
    assert 'did you mean "AdamW"?' in _by_path({"optimizer": {"type": "AdamWW"}})["$.optimizer.type"].message
    message = _by_path({"optimizer": {"type": "sgd"}})["$.optimizer.type"].message
    assert 'did you mean "SGD"? (torch.optim names are case-sensitive)' in message


def test_params_are_checked_against_the_type_in_any_case():
    problems = _by_path({"optimizer": {"type": "adamw", "params": {"momentum": 0.9}}})
    assert problems["$.optimizer.params.momentum"].severity == ERROR
    assert "unexpected keyword argument" in problems["$.optimizer.params.momentum"].message


def test_a_flood_of_unknown_keys_is_capped_and_summarised_in_one_problem():
    """700,000 stray keys once printed 700,000 lines in 50 s (a spelling search each): the first
    MAX_UNKNOWN_KEYS are explained one by one, the rest counted in one problem naming a few."""
    from toolkit.config.explain import MAX_UNKNOWN_KEYS

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {"stage": 1}, **{f"k{i}": i for i in range(20000)}}
    problems = check_schema(cfg)
    assert len(problems) == MAX_UNKNOWN_KEYS + 1
    summary = [p for p in problems if p.path == "$"]
    assert len(summary) == 1 and f"{20001 - MAX_UNKNOWN_KEYS:,} more unknown keys here" in summary[0].message
    assert "ignore them" in summary[0].message
    assert any('did you mean "zero_optimization"' in p.message for p in problems)  # the listed ones keep their advice
