"""Measured per-layer cost: time each pipeline layer's forward + backward on the device training would use.

    spec = models.pipeline_layers(to_hf_config(load_arch("gpt2")))
    times = profile_layers(spec.layers, sample_batch(spec.config, seq_len=512), spec.loss_fn, reps=3)
    parts = partition_layers(costs, pp=4, method="profile", times=times)
    times = profile_model("gpt2", 512, precision="bf16")   # LayerTimes: .device, .dtype say where

Each layer is timed alone on the input the layers before it produce (computed once, detached), so
stage time = sum of its layers' times, as in a pipeline where stages only exchange activations.
Where (`timing_setup`): on the current CUDA device, with the parameters in the run's precision (bf16/fp16
kernels run at other speeds than fp32, and not alike for every layer), when CUDA is available and
DS_ACCELERATOR is not "cpu"; else on the CPU in fp32 (a CPU without bf16 matrix units emulates bf16 matmuls,
which would distort the ratios between layers more than fp32 does). The whole model is built and moved there.
Imports torch: used only by `--method profile` and the benchmarks.
"""

import random
import statistics
import time


def sample_batch(config, seq_len: int, mbs: int = 1, seed: int = 0):
    """(inputs, labels) as the pipeline data iterator yields them: random ids, full attention mask."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (mbs, seq_len), generator=gen)  # (B, T) int64
    inputs = (ids, torch.ones_like(ids))
    if config.model_type == "bert":
        inputs += (torch.zeros_like(ids),)  # token_type_ids
    return inputs, ids.clone()


def build_layers(layers) -> list:
    """(callable, module or None) pairs for layer-list entries.
    Callables for layer-list entries: LayerSpec / TiedLayerSpec are built (tied heads call their
    forward_fn on their own copy of the tied module), nn.Modules and functions are used as they are."""
    from functools import partial

    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    built = []
    for layer in layers:
        if isinstance(layer, LayerSpec):
            module = layer.build(log=False)
            forward_fn = getattr(layer, "forward_fn", None) if isinstance(layer, TiedLayerSpec) else None
            built.append((partial(forward_fn, module) if forward_fn else module, module))
        else:
            built.append((layer, layer if hasattr(layer, "parameters") else None))
    return built


class LayerTimes(list):
    """Median seconds of forward + backward per layer, and where they were measured."""

    def __init__(self, seconds, device: str, dtype: str):
        super().__init__(seconds)
        self.device, self.dtype = device, dtype  # "cuda:0 (NVIDIA H100 80GB HBM3)" / "cpu"; "bf16", "fp32"

    def describe(self) -> str:
        return f"timed on {self.device} in {self.dtype}"


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def timing_setup(precision: str = "bf16", cuda: bool | None = None) -> tuple[str, str]:
    """(torch device, precision) to time layers in (module docstring). cuda: whether a CUDA device is usable
    (None: ask torch, unless DS_ACCELERATOR=cpu)."""
    import os

    import torch

    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(DTYPES)}")
    if cuda is None:
        cuda = os.environ.get("DS_ACCELERATOR") != "cpu" and torch.cuda.is_available()
    return (f"cuda:{torch.cuda.current_device()}", precision) if cuda else ("cpu", "fp32")


def profile_layers(layers, batch, loss_fn, reps: int = 3, warmup: int = 1, device: str = "cpu",
                   precision: str = "fp32") -> list[float]:
    """Median seconds of forward + backward per layer (the last layer includes the loss), on `device` with the
    parameters in `precision` (as DeepSpeed casts them: parameters only, buffers as built)."""
    return [statistics.median(s) for s in layer_samples(layers, batch, loss_fn, reps, warmup, device=device,
                                                        precision=precision)]


def layer_samples(layers, batch, loss_fn, reps: int = 3, warmup: int = 1, clock=time.perf_counter,
                  device: str = "cpu", precision: str = "fp32") -> list[list[float]]:
    """Per layer, `reps` timings in seconds of its forward + backward, after `warmup` untimed rounds.
    clock: wall time by default; with torch.set_num_threads(1) on a CPU, time.thread_time counts only
    the CPU this thread got, which other jobs on a shared machine cannot inflate."""
    import torch

    inputs, labels = _to(batch, device)
    built = _placed(build_layers(layers), device, getattr(torch, DTYPES[precision]))
    layer_inputs = _layer_inputs([fn for fn, _ in built], inputs)
    samples = [[] for _ in built]
    for rep in range(warmup + reps):
        order = list(range(len(built)))
        random.Random(rep).shuffle(order)  # every layer each rep, in a new order: a slow spell of the
        for i in order:                    # machine lands on different layers each time
            fn, module = built[i]
            last = i == len(built) - 1
            seconds = _time_one(fn, layer_inputs[i], loss_fn if last else None, labels, torch, clock)
            if module is not None:
                module.zero_grad(set_to_none=True)
            if rep >= warmup:
                samples[i].append(seconds)
    return samples


def _placed(built: list, device: str, dtype) -> list:
    """The built layers' modules with their parameters in `dtype` (models.pipeline.cast_parameters, what the
    engine does), on `device`."""
    from models.pipeline import cast_parameters

    for _, module in built:
        if module is not None:
            cast_parameters(module, dtype)
            module.to(device)
    return built


def _to(x, device: str):
    if isinstance(x, tuple):
        return tuple(_to(t, device) for t in x)
    return x.to(device) if hasattr(x, "to") else x


def _layer_inputs(fns, inputs) -> list:
    """What each layer receives in the forward pass (detached copies)."""
    import torch

    seen, x = [], inputs
    with torch.no_grad():
        for fn in fns:
            seen.append(x)
            x = fn(x)
    return seen


def _time_one(fn, x, loss_fn, labels, torch, clock) -> float:
    """Seconds for one forward + backward of `fn` on `x`; floating inputs get gradients, as they
    would on a pipeline stage receiving them."""
    x = _as_leaves(x, torch)
    cuda = _on_cuda(x, torch)
    if cuda:
        torch.cuda.synchronize()
    start = clock()
    out = fn(x)
    if loss_fn is not None:
        loss_fn(out, labels).backward()
    else:
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point() and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    if cuda:
        torch.cuda.synchronize()  # kernels run asynchronously: wait for them before reading the clock
    return clock() - start


def _on_cuda(x, torch) -> bool:
    return any(t.is_cuda for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor))


def _as_leaves(x, torch):
    if isinstance(x, tuple):
        return tuple(_as_leaves(t, torch) for t in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


def profile_model(model: str, seq_len: int, mbs: int = 1, reps: int = 3, precision: str = "bf16",
                  cuda: bool | None = None, revision: str = "main") -> LayerTimes:
    """Per-layer forward + backward seconds of `model` (a local HF directory, whose weights are loaded, or a
    built-in name or hub id at `revision`, built from its config with random weights) through models/' layer
    list, where `timing_setup(precision, cuda)` says: the GPU in `precision` where there is one, else the CPU
    in fp32."""
    import os

    import torch

    import models
    from toolkit.plan.arch import load_arch, to_hf_config

    device, used = timing_setup(precision, cuda)
    dtype = getattr(torch, DTYPES[used])
    if os.path.isdir(model):  # read in the timed dtype: no fp32 copy of a bf16 model first
        spec = models.pipeline_layers(model, seq_len=seq_len, dtype=dtype)
    else:
        spec = models.pipeline_layers(to_hf_config(load_arch(model, revision)), seq_len=seq_len)
    times = profile_layers(spec.layers, sample_batch(spec.config, seq_len, mbs), spec.loss_fn, reps=reps,
                           device=device, precision=used)
    name = f"{device} ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else device
    return LayerTimes(times, name, used)
