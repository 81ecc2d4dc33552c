"""The cost model describes the layer list models/ really builds: same layers, parameter counts as
DeepSpeed counts them (each layer built, trainable parameters summed), class names that DeepSpeed's
type:REGEX matches; and `profile` times those real layers."""

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import models  # noqa: E402
from toolkit.plan.arch import BUILTINS, to_hf_config  # noqa: E402
from toolkit.plan.cost.layers import layer_costs  # noqa: E402
from toolkit.plan.cost.partition import partition_layers  # noqa: E402
from toolkit.plan.cost.profile import profile_layers, sample_batch  # noqa: E402


def _deepspeed_param_counts(layers):
    """DeepSpeed's PipelineModule._count_layer_params, on the spec's entries (built one by one)."""
    from deepspeed.pipe import LayerSpec

    counts = []
    for layer in layers:
        module = layer.build(log=False) if isinstance(layer, LayerSpec) else layer
        counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
    return counts


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert"])
def test_costs_describe_the_models_layer_list(name):
    arch = BUILTINS[name]
    spec = models.pipeline_layers(to_hf_config(arch))
    costs = layer_costs(arch, 32)
    assert [c.kind for c in costs] == spec.kinds
    assert [c.params for c in costs] == _deepspeed_param_counts(spec.layers) == spec.param_counts
    assert [c.typename for c in costs] == [layer.typename.__name__ for layer in spec.layers]


def test_profile_method_times_real_layers():
    arch = BUILTINS["tiny-llama"]
    spec = models.pipeline_layers(to_hf_config(arch))
    times = profile_layers(spec.layers, sample_batch(spec.config, seq_len=64, mbs=2), spec.loss_fn, reps=2)
    assert len(times) == arch.num_pipeline_layers and all(t > 0 for t in times)
    parts = partition_layers(layer_costs(arch, 64, 2), 3, "profile", times=times)
    assert len(parts) == 4 and parts[0] == 0 and parts[-1] == len(times)


def test_profile_times_on_the_cpu_in_fp32_and_says_so():
    from toolkit.plan.cost.profile import profile_model

    times = profile_model("tiny-llama", 32, reps=1, precision="bf16")  # no CUDA here: the CPU, fp32
    assert (times.device, times.dtype) == ("cpu", "fp32") and times.describe() == "timed on cpu in fp32"
    assert len(times) == BUILTINS["tiny-llama"].num_pipeline_layers and all(t > 0 for t in times)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_profile_picks_the_gpu_in_the_runs_precision_where_cuda_is(monkeypatch, precision):
    import torch

    from toolkit.plan.cost.profile import timing_setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: what torch would say on one
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert timing_setup(precision) == ("cuda:3", precision)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # a CPU run asked for on a GPU machine
    assert timing_setup(precision) == ("cpu", "fp32")
    assert timing_setup(precision, cuda=False) == ("cpu", "fp32") and timing_setup(precision, cuda=True)[1] == precision


def test_profile_layers_run_with_their_parameters_in_the_asked_dtype():
    """What the GPU path does, on the CPU: parameters cast as DeepSpeed casts them (buffers kept), inputs moved."""
    import torch

    from toolkit.plan.cost.profile import layer_samples

    spec = models.pipeline_layers(to_hf_config(BUILTINS["tiny-llama"]))
    seen, buffers = [], []

    def record(module, args):  # every linear layer as it runs: the dtype of its weight
        if isinstance(module, torch.nn.Linear):
            seen.append(module.weight.dtype)
        buffers.extend(b.dtype for b in module.buffers(recurse=False))

    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        samples = layer_samples(spec.layers, sample_batch(spec.config, seq_len=32), spec.loss_fn, reps=1, warmup=0,
                                device="cpu", precision="bf16")
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16} and all(len(x) == 1 for x in samples)
    assert buffers and set(buffers) == {torch.float32}  # rotary inv_freq: as built, as DeepSpeed leaves it
