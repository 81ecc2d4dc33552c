"""How `dstk train` splits a pipeline (toolkit.distributed.pipeline.choose_parts): recorded parts, the config's
method, "profile" refused before launch, and the fallback to parameter counts said out loud."""

import logging

import pytest

from toolkit.config.options import GenerateOptions
from toolkit.config.problems import ERROR
from toolkit.config.rules import check_rules
from toolkit.errors import ConfigError
from toolkit.plan.cost.partition import partition_balanced, partition_uniform
from toolkit.distributed.pipeline import choose_parts

BATCH = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4}


@pytest.fixture(scope="module")
def llama():
    """A wrapped small llama (2 blocks: 5 layers) whose max_position_embeddings is 64."""
    import models
    from toolkit.train.parity import small_model

    return models.pipeline_layers(small_model("llama"))


def cfg(**pipeline):
    return {**BATCH, "pipeline": {"stages": 2, **pipeline}}


def test_recorded_parts_are_used_as_they_are(llama):
    assert choose_parts(llama, 2, cfg(partition_method="profile", parts=[0, 3, 5])) == ([0, 3, 5], None)


def test_methods_without_a_cost_model(llama):
    assert choose_parts(llama, 2, cfg(partition_method="parameters")) == (partition_balanced(llama.param_counts, 2), None)
    assert choose_parts(llama, 2, cfg(partition_method="uniform")) == (partition_uniform(5, 2), None)


def test_compute_uses_the_cost_model(llama):
    parts, fallback = choose_parts(llama, 2, cfg(), seq_len=32)
    assert fallback is None and parts[0] == 0 and parts[-1] == 5 and len(parts) == 3


def test_fallback_names_the_method_the_model_type_and_the_reason(llama):
    """seq_len 128 > the model's 64 positions: the cost model refuses, parameters are balanced instead."""
    parts, fallback = choose_parts(llama, 2, cfg(partition_method="memory"), seq_len=128)
    assert parts == partition_balanced(llama.param_counts, 2)
    for said in ("partition_method 'memory'", "model_type 'llama'", "--seq-len 128 exceeds", "parameter counts",
                 f"parts {parts}", "dstk partition"):
        assert said in fallback, (said, fallback)


def test_profile_without_parts_is_refused_at_train_time(llama):
    with pytest.raises(ConfigError, match="dstk partition MODEL --pp N --method profile --config FILE"):
        choose_parts(llama, 2, cfg(partition_method="profile"))


def test_the_fallback_is_logged_as_a_warning_on_rank_0(ds_world1, caplog):
    """pipeline_module (what dstk train calls at pp > 1), in a real world of one: one stage, one warning."""
    from toolkit.distributed.topology import Topology
    from toolkit.train.parity import small_model
    from toolkit.distributed.pipeline import pipeline_module

    with caplog.at_level(logging.WARNING, logger="toolkit.distributed.pipeline"):
        module, layout = pipeline_module(small_model("llama"), "causal-lm", Topology(1, 1), cfg(stages=1), seq_len=128)
    [record] = [r for r in caplog.records if r.name == "toolkit.distributed.pipeline"]
    assert record.levelno == logging.WARNING and "model_type 'llama'" in record.getMessage()
    assert layout["parts"] == [0, 5]


def test_validate_refuses_profile_without_parts_and_says_how_to_record_them():
    [p] = [p for p in check_rules(cfg(partition_method="profile"), world_size=2) if p.severity == ERROR]
    assert p.path == "$.pipeline.partition_method"
    assert "dstk partition MODEL --pp 2 --method profile --config FILE" in p.message and '"compute"' in p.message


def test_validate_accepts_profile_with_recorded_parts_or_one_stage():
    assert [p for p in check_rules(cfg(partition_method="profile", parts=[0, 3, 5]), world_size=2)
            if p.severity == ERROR] == []
    one = {**BATCH, "pipeline": {"stages": 1, "partition_method": "profile"}}
    assert [p for p in check_rules(one, world_size=1) if p.severity == ERROR] == []


def test_generate_config_refuses_profile_for_a_pipeline():
    with pytest.raises(ConfigError, match="dstk partition MODEL --pp 2 --method profile --config FILE"):
        GenerateOptions(pp=2, world_size=2, mbs=1, gas=4, partition_method="profile").check()
    GenerateOptions(pp=2, world_size=2, mbs=1, gas=4, partition_method="compute").check()
