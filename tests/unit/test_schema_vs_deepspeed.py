"""schema.json against the installed DeepSpeed: what stops the schema going stale on an upgrade.

Walks DeepSpeed's own pydantic config models, its removed-key tables, the top-level keys
runtime/config.py reads, the plain-dict sections' constants and the optimizer/scheduler
signatures, and fails on any key one side knows and the other does not.
"""

import ast
import inspect
import json
import os
import typing

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

from deepspeed.comm.config import CommsLoggerConfig  # noqa: E402
from deepspeed.compile.config import CompileConfig  # noqa: E402
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig  # noqa: E402
from deepspeed.runtime import config as ds_config  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.utils.config import DeepSpeedThroughputTimerConfig  # noqa: E402

from toolkit.config import schema as S  # noqa: E402
from toolkit.config.validate import check_schema  # noqa: E402

MODELS = {  # dotted schema key -> DeepSpeed's model for it (written here, not read from the schema)
    "zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
    "bfloat16": DeepSpeedBF16Config, "tensorboard": TensorBoardConfig, "wandb": WandbConfig,
    "csv_monitor": CSVConfig, "comet": CometConfig, "comms_logger": CommsLoggerConfig, "compile": CompileConfig,
    "timers.throughput": DeepSpeedThroughputTimerConfig, "hybrid_engine": ds_config.HybridEngineConfig,
}


def _nested_models(model, dotted):
    """(dotted, model) for `model` and every model-typed field below it (Optional[...] unwrapped)."""
    yield dotted, model
    for name, field in model.model_fields.items():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if inspect.isclass(arg) and hasattr(arg, "model_fields"):
                yield from _nested_models(arg, f"{dotted}.{field.alias or name}")


@pytest.mark.parametrize("dotted, model", [pair for key, m in MODELS.items() for pair in _nested_models(m, key)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_pydantic_sections_have_exactly_deepspeeds_fields(dotted, model):
    node = S.node_at(dotted)
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}  # populate_by_name: both work
    assert set(node["properties"]) == names, f"{dotted}: schema-only {set(node['properties']) - names}, " \
                                             f"DeepSpeed-only {names - set(node['properties'])}"
    for name, field in fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        assert bool(node["properties"][name].get("deprecated")) == bool(extra.get("deprecated")), name
    assert node["additionalProperties"] is False  # DeepSpeedConfigModel: extra="forbid"


def test_schema_json_is_what_the_builder_makes_from_this_deepspeed():
    from toolkit.config.schema.build import build_schema

    assert S.load_schema()["x-deepspeed-version"] == deepspeed.__version__
    assert json.loads(json.dumps(build_schema())) == S.load_schema(), "rerun: python -m toolkit.config.schema.build"


def test_removed_keys_match_deepspeeds_tables():
    assert set(S.load_schema()["x-removed"]) == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(S.node_at("zero_optimization")["x-removed"]) == set(ds_config._REMOVED_ZERO_CONFIG_KEYS)


def _top_level_keys_read_by_deepspeed() -> set:
    """Constants runtime/config.py reads straight off the top-level dict: get_scalar_param(param_dict, K),
    param_dict.get(K), K in param_dict, param_dict[K]."""
    tree = ast.parse(inspect.getsource(ds_config))
    keys = set()

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and isinstance(getattr(ds_config, node.id, None), str):
            return getattr(ds_config, node.id)
        return None

    def is_param_dict(node):
        return isinstance(node, ast.Name) and node.id == "param_dict"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "get_scalar_param" and \
                len(node.args) >= 2 and is_param_dict(node.args[0]):
            keys.add(value(node.args[1]))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and is_param_dict(node.func.value):
            keys.add(value(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_param_dict(node.value):
            keys.add(value(node.slice))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and is_param_dict(node.comparators[0]):
            keys.add(value(node.left))
    return keys - {None}


def test_every_top_level_key_deepspeed_reads_is_in_the_schema():
    read = _top_level_keys_read_by_deepspeed()
    assert len(read) > 25 and "train_batch_size" in read and "pipeline" in read  # the parse found them
    known = set(S.keys_at("")) | set(S.load_schema()["x-removed"])
    assert read <= known, f"DeepSpeed reads keys the schema lacks: {sorted(read - known)}"


def test_plain_dict_sections_match_deepspeeds_constants():
    from deepspeed.profiling import constants as prof
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    assert set(S.keys_at("activation_checkpointing")) == set(ACT_CHKPT_DEFAULT)
    assert set(S.keys_at("aio")) == set(AIO_DEFAULT_DICT)
    flops = {v for k, v in vars(prof).items() if k.startswith("FLOPS_PROFILER_") and not k.endswith(("_DEFAULT",
                                                                                                    "_FORMAT"))}
    assert set(S.keys_at("flops_profiler")) == flops
    deepspeed_pipeline = set(ds_config.get_pipeline_config({})) | {"use_reentrant"}  # + pipe/engine.py's get
    assert set(S.keys_at("pipeline")) == deepspeed_pipeline | {"stages", "partition_method", "parts"}


@pytest.mark.parametrize("name", lr_schedules.VALID_LR_SCHEDULES)
def test_scheduler_params_are_the_constructor_arguments(name):
    arguments = set(inspect.signature(getattr(lr_schedules, name)).parameters) - {"optimizer", "self"}
    assert set(S.load_schema()["$defs"][f"{name}_params"]["properties"]) == arguments


def test_optimizer_params_are_the_arguments_of_the_classes_deepspeed_may_pick():
    """runtime/engine.py picks the class at initialize (offload, torch_adam, ...): the schema allows
    the union of their arguments plus the keys DeepSpeed pops itself, and nothing else."""
    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    def args(*classes, drop=()):
        return set().union(*(inspect.signature(c).parameters for c in classes)) - {"params", "model_params", *drop}

    def keys(name):
        return set(S.load_schema()["$defs"][name]["properties"])

    popped_by_deepspeed = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # engine.get_optimizer_configuration
    adam = args(FusedAdam, torch.optim.Adam, torch.optim.AdamW, DeepSpeedCPUAdam, drop={"adamw_mode"})
    assert keys("adam_params") == adam | popped_by_deepspeed
    assert keys("lamb_params") == args(FusedLamb, drop={"max_grad_norm"})  # DeepSpeed refuses max_grad_norm
    assert keys("lion_params") == args(FusedLion, DeepSpeedCPULion)
    assert keys("adagrad_params") == args(torch.optim.Adagrad, DeepSpeedCPUAdagrad)
    assert keys("sgd_params") == args(torch.optim.SGD)


ORACLE = {  # world size 1 (no process group): 8 = 2 x 4 x 1
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "steps_per_print": 1, "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 1e6},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "pipeline": {"stages": 2, "partition_method": "uniform"},
    "activation_checkpointing": {"partition_activations": False}, "checkpoint": {"tag_validation": "Warn"},
    "tensorboard": {"enabled": False}, "comms_logger": {"enabled": False}, "timers": {"throughput": {"enabled": True}},
}


def test_a_config_dstk_accepts_deepspeed_accepts():
    assert check_schema(ORACLE) == []
    parsed = ds_config.DeepSpeedConfig(ORACLE)
    assert parsed.zero_optimization_stage == 1 and parsed.train_batch_size == 8


@pytest.mark.parametrize("section, typo", [("zero_optimization", "stag"), ("fp16", "enabld"), ("wandb", "projet")])
def test_typos_deepspeed_refuses_in_pydantic_sections_dstk_refuses_too(section, typo):
    cfg = {**ORACLE, section: {typo: 1}}
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        ds_config.DeepSpeedConfig(cfg)
    assert any(p.path == f"$.{section}.{typo}" for p in check_schema(cfg))
