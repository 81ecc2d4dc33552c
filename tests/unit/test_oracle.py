"""DeepSpeed is the oracle: every config dstk generates is one DeepSpeed's own parser accepts.

Each generated config goes to `DeepSpeedConfig` at the data-parallel size the config was made for.
DeepSpeed reads that size from an `mpu` object (`get_data_parallel_world_size`, the interface Megatron
and PipelineModule use); the object below answers it, since one test process cannot hold 8 ranks.
A sample goes through `deepspeed.initialize` on a tiny model in this process (world of 1).
"""

import itertools

import pytest
import torch

from toolkit.config.generate import build_config
from toolkit.config.options import GenerateOptions
from toolkit.config.presets import PRESET_DIR, load_presets
from toolkit.config.rules import check_rules
from toolkit.config.validate import check_schema
from toolkit.errors import ConfigError


class DataParallelSize:
    """What DeepSpeedConfig asks an mpu for: the data-parallel world size."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


def deepspeed_accepts(cfg: dict, dp: int):
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(cfg, mpu=DataParallelSize(dp))
    assert parsed.train_batch_size == parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * dp
    return parsed


LAYOUTS = {"dp": dict(world_size=4, pp=1), "pp": dict(world_size=2, pp=2), "hybrid": dict(world_size=4, pp=2)}
OFFLOADS = {"none": {}, "opt-cpu": dict(offload_optimizer="cpu"), "param-nvme": dict(offload_param="nvme", nvme_path="/nvme"),
            "both-cpu": dict(offload_optimizer="cpu", offload_param="cpu")}
MATRIX = list(itertools.product(LAYOUTS, range(4), ("fp32", "bf16", "fp16"), OFFLOADS))


@pytest.mark.parametrize("strategy,zero,precision,offload", MATRIX)
def test_generated_matrix_is_accepted_by_deepspeed(ds_world1, strategy, zero, precision, offload):
    options = GenerateOptions(strategy=strategy, mbs=2, gas=4, zero=zero, precision=precision, **LAYOUTS[strategy],
                              **OFFLOADS[offload])
    try:
        cfg = build_config(options)
    except ConfigError as exc:  # refused: must be for a reason DeepSpeed would also refuse or ignore
        reason = str(exc)
        assert ("PipelineEngine refuses" in reason and zero >= 2 and LAYOUTS[strategy]["pp"] > 1) or \
               ("--offload-param" in reason and zero != 3) or ("--offload-optimizer" in reason and zero == 0), reason
        return
    assert check_schema(cfg) == []
    problems = check_rules(cfg, world_size=options.world_size)
    if precision == "bf16" and zero == 0:  # asked for: bf16 sums gradients in bf16 there, and validate says so
        assert [(p.path, p.severity) for p in problems] == [("$.data_types.grad_accum_dtype", "warning")]
    else:
        assert problems == []
    parsed = deepspeed_accepts(cfg, dp=options.topology().dp)
    assert parsed.zero_optimization_stage == zero
    assert parsed.grad_accum_dtype == ("fp32" if precision == "bf16" and zero >= 1 else None)
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    assert parsed.pipeline["stages"] == LAYOUTS[strategy]["pp"]


@pytest.mark.parametrize("name", sorted(load_presets()))
def test_every_preset_is_accepted_by_deepspeed(ds_world1, name):
    import json

    cfg = json.loads((PRESET_DIR / name).read_text())
    if cfg.get("train_batch_size") == "auto":  # HF presets: the Trainer fills the batch numbers first
        cfg.update(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
        cfg = _fill_auto(cfg, 1e-4)
    dp = cfg["train_batch_size"] // (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"])
    deepspeed_accepts(cfg, dp=dp)


def _fill_auto(value, number):
    if isinstance(value, dict):
        return {k: _fill_auto(v, number if k != "enabled" else False) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_auto(v, number) for v in value]
    return number if value == "auto" else value


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_configs_train_under_deepspeed_initialize(ds_world1, zero, precision):
    import deepspeed

    torch.manual_seed(0)
    cfg = build_config(GenerateOptions(world_size=1, mbs=4, gas=1, zero=zero, precision=precision, cpu=True, lr=1e-2,
                                       steps_per_print=1000))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x, y = torch.randn(4, 8, dtype=dtype), torch.randn(4, 1, dtype=dtype)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    engine.destroy()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generate_config_defaults_build_no_jit_op(ds_world1, monkeypatch, zero, precision):
    """`dstk generate-config` without --cpu (a GPU config): DeepSpeed builds torch's fused AdamW from it,
    and loads no op (DeepSpeed's FusedAdam, the old default, is JIT-built and needs nvcc and CUDA_HOME)."""
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder

    def no_build(builder, *args, **kwargs):
        raise AssertionError(f"DeepSpeed loaded op {builder.name!r}: a JIT build on a fresh machine")

    monkeypatch.setattr(OpBuilder, "load", no_build)
    cfg = build_config(GenerateOptions(world_size=1, mbs=2, gas=1, zero=zero, precision=precision))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert type(engine.basic_optimizer) is torch.optim.AdamW and engine.basic_optimizer.defaults["fused"] is True
    engine.destroy()
