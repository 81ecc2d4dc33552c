"""Write toolkit/config/schema/schema.json from DeepSpeed's pydantic config models plus the hand-written sections.

    python -m toolkit.config.schema.build            # rewrite schema.json (after a DeepSpeed upgrade)
    python -m toolkit.config.schema.build --check    # exit 1 if schema.json is stale

The pydantic sections (zero_optimization, fp16, bf16, monitors, compile, ...) are read from the
installed DeepSpeed: names, aliases, types, bounds, defaults, and the attribute docstrings that
DeepSpeed writes under each field. Everything else comes from sections.py / optim.py.
This module imports deepspeed (inside functions): it is a build step, never part of `dstk validate`.
"""

import json
import os
import sys
from pathlib import Path

from toolkit.config.schema import optim, sections
from toolkit.config.schema.parts import AUTO_REF, exclude_auto
from toolkit.config.schema.pydantic import model_schema

SCHEMA_PATH = Path(__file__).with_name("schema.json")

# Keys inside pydantic sections that the HF Trainer / Accelerate fill when they hold "auto".
AUTO_KEYS = {
    "zero_optimization": ["stage", "reduce_bucket_size", "stage3_prefetch_bucket_size",
                          "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save"],
    "zero_optimization.offload_optimizer": ["device", "nvme_path"],
    "zero_optimization.offload_param": ["device", "nvme_path"],
    "fp16": ["enabled"], "bf16": ["enabled"],
}


def pydantic_sections() -> dict:
    """Top-level key -> (pydantic model class, description). Imports deepspeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        "zero_optimization": (DeepSpeedZeroConfig, "ZeRO: partition optimizer state (1), gradients (2) "
                              "and parameters (3) across data-parallel ranks; offload to CPU/NVMe."),
        "fp16": (DeepSpeedFP16Config, "fp16 mixed precision with loss scaling."),
        "bf16": (DeepSpeedBF16Config, "bfloat16 mixed precision."),
        "bfloat16": (DeepSpeedBF16Config, "Deprecated spelling of \"bf16\" (read only when bf16 is absent)."),
        "tensorboard": (TensorBoardConfig, "TensorBoard monitor."),
        "wandb": (WandbConfig, "Weights & Biases monitor."),
        "csv_monitor": (CSVConfig, "CSV file monitor."),
        "comet": (CometConfig, "Comet monitor."),
        "comms_logger": (CommsLoggerConfig, "Log every collective call (present: enabled by DeepSpeed)."),
        "compile": (CompileConfig, "torch.compile / DeepCompile settings."),
        "hybrid_engine": (HybridEngineConfig, "Hybrid training/inference engine (RLHF)."),
        "tensor_parallel": (TPTrainingConfig, "Automatic tensor parallelism for training (AutoTP)."),
        "weight_quantization": (WeightQuantConfig, "Weight quantization (inference config model)."),
    }


def timers_section() -> dict:
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    return {"type": "object", "description": "Timers (utils/config.py); only \"throughput\" is read.",
            "additionalProperties": False,
            "properties": {"throughput": model_schema(DeepSpeedThroughputTimerConfig, "Throughput timer.")}}


def expert_parallel_section() -> dict:
    """AutoEP keys, read off module_inject/auto_ep_config.parse_autoep_config (a plain-dict reader):
    `param_dict.get("key", default)` and `"key" in param_dict`."""
    import ast
    import inspect

    from deepspeed.module_inject import auto_ep_config

    tree = ast.parse(inspect.getsource(auto_ep_config.parse_autoep_config))
    props = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and \
                getattr(node.func.value, "id", "") == "param_dict":
            default = ast.literal_eval(node.args[1]) if len(node.args) > 1 else None
            props[node.args[0].value] = _loose_prop(node.args[0].value, default)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            props.setdefault(node.left.value, _loose_prop(node.left.value, None))
    props.update(_expert_parallel_core())
    return {"type": "object", "additionalProperties": False, "default": {},
            "description": "AutoEP expert parallelism (module_inject/auto_ep_config.py, read as a plain dict).",
            "properties": dict(sorted(props.items()))}


def _expert_parallel_core() -> dict:
    """The keys a layout depends on, typed as DeepSpeed uses them (AutoEPConfig's fields, its preset registry)."""
    from deepspeed.module_inject.auto_ep_presets.registry import available_preset_names

    def size(what):
        return {"description": what, "type": "integer", "minimum": 1, "default": 1}

    return {
        "enabled": {"description": "Replace the model's MoE blocks with AutoEP layers at deepspeed.initialize; "
                    "without it the section is ignored.", "type": "boolean", "default": False},
        "autoep_size": size("Expert-parallel degree: each group of this many consecutive ranks of a stage "
                            "shares one copy of the experts (experts / autoep_size each); divides world / pp "
                            "and every MoE block's expert count."),
        "expert_tensor_parallel_size": size("Tensor parallelism inside each expert; DeepSpeed 0.19 accepts only 1."),
        "preset_model": {"description": "The AutoEP preset naming the model's MoE modules; null tries each.",
                         "type": ["string", "null"], "enum": [*available_preset_names(), None], "default": None},
    }


def _loose_prop(key: str, default) -> dict:
    """Type from DeepSpeed's default: "auto" defaults also take numbers; None takes anything."""
    any_type = ["string", "number", "boolean", "array", "object", "null"]
    by_default = {bool: "boolean", int: "number", float: "number", str: ["string", "number"]}
    out = {"description": f"AutoEP setting \"{key}\" (see DeepSpeed's AutoEP docs).",
           "type": by_default.get(type(default), any_type)}
    if default is not None:
        out["default"] = default
    return out


def removed_keys() -> tuple[dict, dict]:
    """Keys DeepSpeed 0.19 refuses (top level, zero_optimization) -> its reason, without the URL."""
    from deepspeed.runtime import config as ds_config

    def short(messages):
        return {key: msg.split(" See http")[0].strip() for key, msg in messages.items()}

    return short(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS), short(ds_config._REMOVED_ZERO_CONFIG_KEYS)


def mark_auto(sections: dict) -> None:
    """Let "auto" through (as anyOf with $defs/auto) at the keys the HF integration fills."""
    for dotted, keys in AUTO_KEYS.items():
        node = sections[dotted.split(".")[0]]
        for part in dotted.split(".")[1:]:
            node = node["properties"][part]
        for key in keys:
            prop = node["properties"][key]
            body = {k: prop.pop(k) for k in list(prop) if k not in ("description", "default", "deprecated")}
            prop["anyOf"] = [exclude_auto(body), AUTO_REF]


def build_schema() -> dict:
    import deepspeed

    top = dict(sections.top_level_scalars())
    pyd = {key: model_schema(model, desc) for key, (model, desc) in pydantic_sections().items()}
    pyd["bfloat16"]["deprecated"] = True
    mark_auto(pyd)
    optimizer, optimizer_defs = optim.optimizer()
    scheduler, scheduler_defs = optim.scheduler()
    removed_top, removed_zero = removed_keys()
    pyd["zero_optimization"]["x-removed"] = removed_zero
    top.update(pyd)
    top.update({
        "optimizer": optimizer, "scheduler": scheduler, "timers": timers_section(),
        "pipeline": sections.pipeline(),
        "activation_checkpointing": sections.activation_checkpointing(),
        "flops_profiler": sections.flops_profiler(), "checkpoint": sections.checkpoint(),
        "data_types": sections.data_types(), "aio": sections.aio(),
        "torch_autocast": sections.torch_autocast(), "autotuning": sections.autotuning(),
        "data_efficiency": sections.data_efficiency(), "expert_parallel": expert_parallel_section(),
        **sections.open_sections(),
    })
    auto = {"const": "auto", "description": "Filled in by the HF Trainer / Accelerate DeepSpeed "
            "integration; DeepSpeed alone drops or rejects it."}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://dstk.invalid/schemas/deepspeed-config.schema.json",
        "title": "DeepSpeed config", "type": "object",
        "description": f"A DeepSpeed {deepspeed.__version__} training config as dstk checks it.",
        "x-deepspeed-version": deepspeed.__version__,
        "additionalProperties": False, "x-removed": removed_top,
        "properties": top, "$defs": {"auto": auto, **optimizer_defs, **scheduler_defs},
    }


def main(argv=None) -> int:
    text = json.dumps(build_schema(), indent=2, ensure_ascii=False) + "\n"
    if "--check" in (argv if argv is not None else sys.argv[1:]):
        stale = SCHEMA_PATH.read_text(encoding="utf-8") != text
        print(f"{SCHEMA_PATH} is {'STALE: rerun python -m toolkit.config.schema.build' if stale else 'up to date'}")
        return 1 if stale else 0
    SCHEMA_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_PATH} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
