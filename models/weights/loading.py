"""An HF model built or loaded whole in the dtype a run trains it in (a pipeline stage reads only its own layers,
models.weights.source, in the same dtype: `param_dtype`).

    dtype = param_dtype(ds_config)                       # what DeepSpeed casts the parameters to: bf16, fp16, fp32
    model = build_model("path/to/hf_dir", config, "causal-lm", seed=0, ds_config=cfg)  # loaded in that dtype
    model = random_model(config, "causal-lm", seed=0)    # random weights from a seed, the same on every rank

A directory's weights never pass through a whole fp32 copy under bf16 (`build_model`); under ZeRO-3 the model is
built already partitioned (`partition` for a model built whole).
"""

from pathlib import Path


def param_dtype(ds_config: dict | None):
    """The dtype DeepSpeed casts a module's parameters to under `ds_config` (engine._mixed_precision_dtypes):
    fp16 or bf16 when that mode is enabled, read as DeepSpeed reads it (the old "bfloat16" key included),
    else fp32."""
    import torch

    if not ds_config:
        return torch.float32
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    if get_float16_config(ds_config).enabled:
        return torch.float16
    return torch.bfloat16 if get_bfloat16_config(ds_config).enabled else torch.float32


def build_model(model: str, config, task: str, seed: int, ds_config: dict | None = None):
    """Pretrained weights from a directory, or random ones from `seed` (the same on every rank).

    A directory's weights load in the dtype DeepSpeed gives the parameters under `ds_config` (param_dtype):
    bf16 under bf16, never a whole fp32 copy first (DeepSpeed's bf16/fp16 modes cast the module and keep
    fp32 masters themselves, made from those values); fp32 under an fp32 config, each tensor cast as it is
    read (transformers 5 would keep a bf16 checkpoint bf16, dtype="auto", and an optimizer stepping bf16
    weights loses every update below bf16's resolution). Buffers keep the dtype an fp32 build gives them.
    Random weights are drawn in fp32, the same at every ZeRO stage. ZeRO-3 (`ds_config` stage 3): a directory's
    model is built already partitioned (deepspeed.zero.Init; from_pretrained through HF's HfDeepSpeedConfig), so
    no rank ever holds it whole; a built-in is built whole, then partitioned (`partition`)."""
    import torch

    import models

    cls = models.auto_class(task)
    torch.manual_seed(seed)  # heads that a pretrained directory lacks get the same init everywhere
    attn = {"attn_implementation": config._attn_implementation}
    zero3 = ((ds_config or {}).get("zero_optimization") or {}).get("stage") == 3
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # an earlier ZeRO-3 model in this process must not make this one ZeRO-3
    dtype = param_dtype(ds_config) if Path(model).is_dir() else torch.float32
    with torch.device("meta"):  # the fp32 build's buffers (shapes and dtypes only); never under zero.Init
        reference = cls.from_config(config, dtype=torch.float32, **attn) if dtype != torch.float32 else None

    # ZeRO-3: transformers builds (and initialises, and loads) inside deepspeed.zero.Init while an
    # HfDeepSpeedConfig is alive (it holds it by weak reference; HF's docs ask to keep it for the
    # model's lifetime, so the model carries it). Without "tensor_parallel": transformers 5 refuses to load
    # any checkpoint whose keys it renames (integrations/deepspeed.py _apply_weight_conversions_to_state_dict:
    # "Weight conversions ... with DeepSpeed Tensor Parallelism are not yet implemented", llama included)
    # when the config names an autotp_size; AutoTP shards the loaded model later, in deepspeed.initialize.
    loading = {k: v for k, v in (ds_config or {}).items() if k != "tensor_parallel"}
    if Path(model).is_dir():  # transformers 5 initialises only what the checkpoint lacks
        zero3_config = HfDeepSpeedConfig(loading) if zero3 else None
        built = cls.from_pretrained(model, config=config, dtype=dtype, **attn)
        if reference is not None:
            fp32_buffers(built, reference)
    else:  # random: built whole, as at ZeRO 0-2 (under zero.Init HF draws other weights: another first loss)
        built = random_model(config, task, seed, dtype=torch.float32, **attn)
        zero3_config = HfDeepSpeedConfig(loading) if zero3 else None
        if zero3:
            partition(built, zero3_config.config)
    built.dstk_hf_deepspeed_config = zero3_config
    return built


def random_model(config, task: str = "causal-lm", seed: int = 0, cls=None, **kwargs):
    """The HF model of `config` with random weights drawn from `seed`: the one place dstk, its benchmarks
    and its tests build a model from a config. task: a models/ task (causal-lm, sequence-classification,
    ...) naming the class, unless `cls` is given; kwargs go to transformers' _from_config (dtype,
    attn_implementation). Weights as the class's constructor draws them, in train mode."""
    import torch

    import models

    cls = cls or models.auto_class(task, config)
    torch.manual_seed(seed)
    return cls._from_config(config, **kwargs)


def partition(model, ds_config: dict) -> None:
    """Partition a built model's parameters as deepspeed.zero.Init would have built them: in the dtype
    DeepSpeed trains them in (param_dtype: the engine casts only models that were not built partitioned),
    each rank keeping its share. For the built-in models, whose random weights must not depend on the
    ZeRO stage; each rank holds the whole fp32 model for a moment (as at ZeRO 0-2)."""
    import deepspeed

    dtype = param_dtype(ds_config)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)


def fp32_buffers(model, reference) -> None:
    """Give `model`, loaded in 16 bits, the buffers of `reference` (the same model built in fp32 on the meta
    device). transformers builds under the load dtype as torch's default, so a buffer made from a Python
    float (gemma's embed_scale) comes out in 16 bits where the fp32 build keeps it fp32, and DeepSpeed
    casts parameters only. Such a buffer is recomputed by the model's own init on a copy of its module
    whose parameters stay on meta; a persistent one (read from the checkpoint) is cast back."""
    import copy

    import torch
    from transformers import initialization

    wanted = dict(reference.named_buffers())
    for name, buf in list(model.named_buffers()):
        if name not in wanted or buf.dtype == wanted[name].dtype:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr not in owner._non_persistent_buffers_set:
            owner._buffers[attr] = buf.to(wanted[name].dtype)
            continue
        fresh = copy.deepcopy(reference.get_submodule(owner_name))
        fresh._buffers[attr] = torch.empty_like(wanted[name], device=buf.device)
        with torch.no_grad(), initialization.guard_torch_init_functions():
            model._init_weights(fresh)  # its meta parameters take no memory and no values
        owner._buffers[attr] = fresh._buffers[attr]
