"""The judgements of test_config_judgement.py checked against the installed DeepSpeed itself.

(b) every key dstk now takes as null, DeepSpeedConfig takes too; (c) the type names dstk accepts are
exactly those runtime/engine.py resolves, less the classes it finds but cannot build from JSON;
(d) the stage tables match _configure_zero_optimizer, the WARNINGs are configs DeepSpeed parses
(and then ignores the key), the ERRORs are configs DeepSpeed refuses.
"""

import inspect
import os
import types

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402

from tests.unit.test_config_judgement import NULL_OK, _with  # noqa: E402
from toolkit.config import schema as S  # noqa: E402
from toolkit.config.problems import ERROR, WARNING  # noqa: E402
from toolkit.config.rules import check_rules  # noqa: E402
from toolkit.config.validate import check_schema  # noqa: E402
from toolkit.config.rules.zero_stages import OFFLOAD_OPTIMIZER_READ_AT, READ_AT  # noqa: E402

BATCH = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}


# (b) -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dotted", NULL_OK)
def test_deepspeed_config_takes_the_nulls_dstk_takes(dotted):
    DeepSpeedConfig({**_with(dotted, None), **BATCH})


@pytest.mark.parametrize("dotted", ["zero_optimization.stage", "fp16.enabled", "torch_autocast.dtype",
                                    "torch_autocast.lower_precision_safe_modules"])
def test_deepspeed_config_refuses_the_nulls_dstk_refuses(dotted):
    assert any(p.severity == ERROR for p in check_schema(_with(dotted, None)))
    with pytest.raises(Exception):
        DeepSpeedConfig({**_with(dotted, None), **BATCH})


# (c) -------------------------------------------------------------------------------------------------------------

def _resolves_scheduler(name: str) -> bool:
    """runtime/engine.py _scheduler_from_config, run on a stand-in engine: False when it asserts."""
    engine = types.SimpleNamespace(scheduler_name=lambda: name, scheduler_params=lambda: {})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    try:
        DeepSpeedEngine._scheduler_from_config(engine, optimizer)
    except AssertionError as exc:
        assert "does not recognize" in str(exc)
        return False
    except Exception:  # found, but {} is not enough to build it (StepLR needs step_size, ...)
        pass
    return True


def test_scheduler_names_are_exactly_what_deepspeed_resolves():
    node = S.node_at("scheduler.type")
    accepted, refused = set(node["examples"]), set(node["x-refused"])
    assert not accepted & refused
    assert all(_resolves_scheduler(n) for n in accepted | refused)
    torch_classes = {n for n, c in vars(torch.optim.lr_scheduler).items() if inspect.isclass(c) and not
                     n.startswith("_") and issubclass(c, (torch.optim.lr_scheduler.LRScheduler,
                                                          torch.optim.lr_scheduler.ReduceLROnPlateau))}
    assert accepted | refused == set(lr_schedules.VALID_LR_SCHEDULES) | torch_classes


@pytest.mark.parametrize("name", ["warmuplr", "WarmupLr", "steplr", "Warmup", "LR_SCHEDULE"])
def test_scheduler_names_dstk_refuses_deepspeed_does_not_resolve(name):
    assert [p.path for p in check_schema({"scheduler": {"type": name, "params": {}}})] == ["$.scheduler.type"]
    assert not _resolves_scheduler(name) or not inspect.isclass(getattr(lr_schedules, name, None))


def _supported_optimizer(name: str) -> bool:
    """DeepSpeedConfig lower-cases DeepSpeed's own names; engine._is_supported_optimizer checks the result."""
    parsed = DeepSpeedConfig({**BATCH, "optimizer": {"type": name}})
    return DeepSpeedEngine._is_supported_optimizer(None, parsed.optimizer_name)


def test_optimizer_names_are_exactly_what_deepspeed_resolves():
    node = S.node_at("optimizer.type")
    ours = set(deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS)  # matched in any case
    deepspeed_names = [n for n in node["examples"] if n.lower() in ours]
    assert {n.lower() for n in deepspeed_names} == ours
    names = node["examples"] + [n.upper() for n in deepspeed_names] + [n.lower() for n in deepspeed_names]
    assert all(_supported_optimizer(n) for n in names)
    torch_only = {n for n, c in vars(torch.optim).items() if inspect.isclass(c) and not n.startswith("_")
                  and issubclass(c, torch.optim.Optimizer) and n.lower() not in ours}
    assert (set(node["examples"]) - set(deepspeed_names)) | set(node["x-refused"]) == torch_only
    assert not set(node["examples"]) & set(node["x-refused"])
    assert "closure" in inspect.signature(torch.optim.LBFGS.step).parameters  # why LBFGS is refused
    assert inspect.signature(torch.optim.LBFGS.step).parameters["closure"].default is inspect.Parameter.empty


@pytest.mark.parametrize("name", ["sgd", "Rmsprop", "AdamWW", "adam_w"])
def test_optimizer_names_dstk_refuses_deepspeed_does_not_support(name):
    assert [p.path for p in check_schema({"optimizer": {"type": name}})] == ["$.optimizer.type"]
    assert not _supported_optimizer(name)


def test_typo_in_scheduler_type_fails_deepspeed_initialize_and_dstk(ds_world1):
    good = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": None},
            "scheduler": {"type": "StepLR", "params": {"step_size": 1}}}
    assert [p for p in check_schema(good) + check_rules(good, world_size=1) if p.severity == ERROR] == []
    model = torch.nn.Linear(2, 1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=good)
    assert type(engine.lr_scheduler).__name__ == "StepLR"
    engine.destroy()
    bad = {**good, "scheduler": {"type": "steplr", "params": {"step_size": 1}}}
    assert 'did you mean "StepLR"?' in check_schema(bad)[0].message
    with pytest.raises(AssertionError, match="does not recognize LR scheduler steplr"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=bad)


# (d) -------------------------------------------------------------------------------------------------------------

def _zero_keys() -> set:
    fields = DeepSpeedZeroConfig.model_fields
    return set(fields) | {f.alias for f in fields.values() if f.alias}


def test_stage_tables_name_real_keys():
    assert set(READ_AT) <= _zero_keys()
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    assert set(OFFLOAD_OPTIMIZER_READ_AT) <= set(DeepSpeedZeroOffloadOptimizerConfig.model_fields)


ACCESSORS = {  # engine accessor -> zero_optimization key it returns (runtime/engine.py)
    "zero_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "zero_max_live_parameters": "stage3_max_live_parameters",
    "zero_param_persistence_threshold": "stage3_param_persistence_threshold",
    "zero_model_persistence_threshold": "stage3_model_persistence_threshold",
    "zero_max_reuse_distance": "stage3_max_reuse_distance", "zero_offload_param": "offload_param",
    "zero_sub_group_size": "sub_group_size", "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_quantized_weights": "zero_quantized_weights", "zero_allgather_sequential": "stage3_allgather_sequential",
    "zero_quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
    "zero_module_granularity_threshold": "stage3_module_granularity_threshold",
    "zero_log_trace_cache_warnings": "log_trace_cache_warnings", "is_sanity_checks_enabled": "enable_sanity_checks",
    "zero_save_muon_momentum_buffer_in_memory": "save_muon_momentum_buffer_in_memory",
    "zero_round_robin_gradients": "round_robin_gradients", "zero_parameter_alignment": "parameter_alignment",
    "zero_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "zero_ignore_unused_parameters": "ignore_unused_parameters", "zero_allgather_bucket_size": "allgather_bucket_size",
    "zero_reduce_bucket_size": "reduce_bucket_size", "zero_contiguous_gradients": "contiguous_gradients",
    "zero_reduce_scatter": "reduce_scatter",
}


def test_stage_tables_match_configure_zero_optimizer():
    """Each accessor appears in the branches of _configure_zero_optimizer of exactly the stages the table says."""
    source = inspect.getsource(DeepSpeedEngine._configure_zero_optimizer)
    low, high = source.split("elif zero_stage == ZeroStageEnum.weights:")
    for accessor, key in ACCESSORS.items():
        stages = {s for s, branch in (((1, 2), low), ((3,), high)) if f"self.{accessor}()" in branch for s in s}
        assert stages == set(READ_AT[key]) - {0}, f"{key}: read at {sorted(stages)}, table says {READ_AT[key]}"


def _default(key: str):
    """DeepSpeed's default, or a harmless value of the key's type where the default is None."""
    value = S.default(f"zero_optimization.{key}")
    if value is not None:
        return value
    return {} if "object" in S.node_at(f"zero_optimization.{key}")["type"] else False


@pytest.mark.parametrize("key", sorted(READ_AT))
def test_each_warning_is_a_config_deepspeed_parses(key):
    stage = next(s for s in range(4) if s not in READ_AT[key])
    zero = {"stage": stage, key: _default(key)}
    warned = [p for p in check_rules({**BATCH, "zero_optimization": zero}, world_size=1) if p.severity == WARNING]
    assert [p.path for p in warned] == [f"$.zero_optimization.{key}"]
    parsed = DeepSpeedConfig({**BATCH, "zero_optimization": zero})
    assert parsed.zero_optimization_stage == stage


@pytest.mark.parametrize("cfg", [
    {"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
    {"zero_optimization": {"stage": 0, "compute_grad_norm": False}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
    {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
    {"fp16": {"fp16_master_weights_and_grads": True}},
    {"bf16": {"bf16_master_weights_and_grads": True}},
    {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
])
def test_each_stage_error_is_a_config_deepspeed_refuses(cfg):
    assert any(p.severity == ERROR for p in check_rules({**BATCH, **cfg}, world_size=1))
    with pytest.raises(Exception):
        DeepSpeedConfig({**BATCH, **cfg})
