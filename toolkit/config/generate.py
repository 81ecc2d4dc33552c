"""GenerateOptions -> a DeepSpeed config dict, and writing it safely.

The dict carries the topology in its `pipeline` section (stages, partition_method), so every later
step (validate, partition, train) reads the same numbers from the file.
"""

import json

from toolkit.config.options import GenerateOptions
from toolkit.config.rules.expert_parallel import expert_parallel_section
from toolkit.errors import ConfigError
from toolkit.files import write_text

AUTO = "auto"  # filled by the HF Trainer / Accelerate, never by DeepSpeed itself


def build_config(o: GenerateOptions) -> dict:
    """Check the options (all problems at once) and build the config dict."""
    topo, batch = o.check()
    auto = (lambda value: AUTO) if o.hf else (lambda value: value)
    cfg = {
        "train_batch_size": auto(batch.gbs),
        "train_micro_batch_size_per_gpu": auto(batch.mbs),
        "gradient_accumulation_steps": auto(batch.gas),
        "steps_per_print": o.steps_per_print,
        "wall_clock_breakdown": False,
    }
    if topo.tp > 1:  # DeepSpeed 0.19 checks train_batch_size against mbs * gas * WORLD (runtime/config.py:471)
        del cfg["train_batch_size"]
    if o.gradient_clipping is not None:  # always explicit: DeepSpeed's own default clips at 1.0
        cfg["gradient_clipping"] = auto(o.gradient_clipping)
    cfg.update(_precision(o))
    cfg["zero_optimization"] = _zero(o)
    if o.precision == "bf16" and o.zero >= 1:  # gradients summed in fp32 (BF16_Optimizer at ZeRO-1), not in bf16
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if topo.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": topo.tp}
    if topo.sp > 1:
        cfg["sequence_parallel_size"] = topo.sp
    if o.ep > 1 or o.ep_preset:
        cfg["expert_parallel"] = expert_parallel_section(o.ep, o.ep_preset)
    if o.optimizer != "none":
        cfg["optimizer"] = _optimizer(o, auto)
    if o.scheduler != "none":
        cfg["scheduler"] = _scheduler(o, auto)
    cfg["pipeline"] = {"stages": topo.pp, "partition_method": o.partition_method}
    if o.activation_checkpointing:
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
        cfg["pipeline"]["activation_checkpoint_interval"] = 1
    cfg.update(_monitors(o))
    cfg.update(o.extra)
    return cfg


def _precision(o: GenerateOptions) -> dict:
    if o.hf:  # the Trainer sets these from its --bf16 / --fp16 flags
        return {"bf16": {"enabled": AUTO}, "fp16": {"enabled": AUTO}} if o.precision != "fp32" else {}
    if o.precision == "bf16":
        return {"bf16": {"enabled": True}}
    if o.precision == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": o.loss_scale, "initial_scale_power": o.initial_scale_power,
                         "loss_scale_window": o.loss_scale_window, "hysteresis": o.hysteresis,
                         "min_loss_scale": o.min_loss_scale}}
    return {}


def _zero(o: GenerateOptions) -> dict:
    zero = {"stage": o.zero}
    for key, device in (("offload_optimizer", o.offload_optimizer), ("offload_param", o.offload_param)):
        if device != "none":
            zero[key] = {"device": device, "pin_memory": True}
            if device == "nvme":
                zero[key]["nvme_path"] = o.nvme_path
    if o.zero >= 2:
        zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if o.hf and o.zero == 3:
        zero.update({"reduce_bucket_size": AUTO, "stage3_prefetch_bucket_size": AUTO,
                     "stage3_param_persistence_threshold": AUTO})
    return zero


def _optimizer(o: GenerateOptions, auto) -> dict:
    if o.optimizer == "SGD":
        params = {"lr": auto(o.lr), "momentum": o.momentum, "weight_decay": auto(o.weight_decay)}
    elif o.optimizer == "Adagrad":
        params = {"lr": auto(o.lr), "eps": auto(o.eps), "weight_decay": auto(o.weight_decay)}
    else:  # Adam, AdamW, Lamb
        params = {"lr": auto(o.lr), "betas": auto(list(o.betas)), "eps": auto(o.eps),
                  "weight_decay": auto(o.weight_decay)}
    if o.optimizer in ("Adam", "AdamW") and not o.fused_adam and o.offload_optimizer == "none":
        # torch.optim's AdamW, not DeepSpeed's FusedAdam: that op is JIT-built at the first run and needs
        # nvcc and CUDA_HOME (~100 s on CPU). torch's fused kernel on GPUs (one launch per step)
        params["torch_adam"] = True
        if not o.cpu:
            params["fused"] = True
    return {"type": o.optimizer, "params": params}


def _scheduler(o: GenerateOptions, auto) -> dict:
    if o.scheduler == "OneCycle":  # rises from warmup_min_lr to lr over warmup_steps, then falls back
        params = {"cycle_min_lr": o.warmup_min_lr, "cycle_max_lr": o.lr, "cycle_first_step_size": o.warmup_steps}
        return {"type": "OneCycle", "params": params}
    if o.scheduler == "LRRangeTest":  # lr = lr * (1 + step / warmup_steps): rises until training diverges
        params = {"lr_range_test_min_lr": o.lr, "lr_range_test_step_size": o.warmup_steps,
                  "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False}
        return {"type": "LRRangeTest", "params": params}
    if o.scheduler == "WarmupCosineLR":  # ratios of the optimizer's lr
        params = {"warmup_num_steps": auto(o.warmup_steps), "total_num_steps": auto(o.total_steps),
                  "warmup_min_ratio": o.warmup_min_lr / o.lr, "cos_min_ratio": 0.0001}
        return {"type": "WarmupCosineLR", "params": params}
    params = {"warmup_min_lr": auto(o.warmup_min_lr), "warmup_max_lr": auto(o.lr),
              "warmup_num_steps": auto(o.warmup_steps)}
    if o.scheduler == "WarmupDecayLR":
        params["total_num_steps"] = auto(o.total_steps)
    return {"type": o.scheduler, "params": params}


def _monitors(o: GenerateOptions) -> dict:
    sections = {"tensorboard": "tensorboard", "csv": "csv_monitor", "wandb": "wandb"}
    out = {}
    for name in o.monitors:
        if name == "wandb":
            out["wandb"] = {"enabled": True, "project": o.job_name}
        else:
            out[sections[name]] = {"enabled": True, "output_path": o.monitor_dir, "job_name": o.job_name}
    return out


def record_partition(path: str, pp: int, method: str, parts: list) -> dict:
    """Write a partition into the `pipeline` section of an existing config (atomically), so every
    rank builds the same stages. Refuses a config made for another stage count."""
    from toolkit.config.loader import load_config
    from toolkit.config.problems import raise_errors

    cfg, problems = load_config(path)
    raise_errors(problems, path)
    section = cfg.setdefault("pipeline", {})
    if not isinstance(section, dict):
        raise ConfigError(f'{path}: "pipeline" must be an object, got {type(section).__name__}')
    stages = section.get("stages", pp)
    if stages not in (pp, "auto"):
        raise ConfigError(f'{path} has "pipeline.stages" {stages} but --pp is {pp}: the config was made for '
                          f"another topology; use --pp {stages}, or regenerate the config with --pp {pp}")
    section.update(stages=pp, partition_method=method, parts=list(parts))
    write_config(cfg, path, force=True, flag="--config")
    return cfg


def dumps(cfg: dict) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def write_config(cfg: dict, path: str, force: bool = False, flag: str = "-o") -> None:
    """Write `cfg` as JSON atomically; see toolkit.files.write_text."""
    write_text(dumps(cfg), path, force=force, flag=flag)
