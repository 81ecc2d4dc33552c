"""Measured per-layer cost: time each pipeline layer's forward + backward on the current device.

    spec = models.pipeline_layers(to_hf_config(load_arch("gpt2")))
    times = profile_layers(spec.layers, sample_batch(spec.config, seq_len=512), spec.loss_fn, reps=3)
    parts = partition_layers(costs, pp=4, method="profile", times=times)

Each layer is timed alone on the input the layers before it produce (computed once, detached), so
stage time = sum of its layers' times, as in a pipeline where stages only exchange activations.
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


def profile_layers(layers, batch, loss_fn, reps: int = 3, warmup: int = 1) -> list[float]:
    """Median seconds of forward + backward per layer (the last layer includes the loss)."""
    return [statistics.median(s) for s in layer_samples(layers, batch, loss_fn, reps, warmup)]


def layer_samples(layers, batch, loss_fn, reps: int = 3, warmup: int = 1, clock=time.perf_counter) -> list[list[float]]:
    """Per layer, `reps` timings in seconds of its forward + backward, after `warmup` untimed rounds.
    clock: wall time by default; with torch.set_num_threads(1) on a CPU, time.thread_time counts only
    the CPU this thread got, which other jobs on a shared machine cannot inflate."""
    import torch

    inputs, labels = batch
    built = build_layers(layers)
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
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = clock()
    out = fn(x)
    if loss_fn is not None:
        loss_fn(out, labels).backward()
    else:
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point() and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock() - start


def _as_leaves(x, torch):
    if isinstance(x, tuple):
        return tuple(_as_leaves(t, torch) for t in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


def profile_model(model: str, seq_len: int, mbs: int = 1, reps: int = 3) -> list[float]:
    """Per-layer forward + backward seconds of `model` (a local HF directory, whose weights are
    loaded, or a built-in name, built with random weights) through models/' layer list."""
    import os

    import models
    from toolkit.plan.arch import load_arch, to_hf_config

    source = model if os.path.isdir(model) else to_hf_config(load_arch(model))
    spec = models.pipeline_layers(source, seq_len=seq_len)
    return profile_layers(spec.layers, sample_batch(spec.config, seq_len, mbs), spec.loss_fn, reps=reps)
