"""The cost model describes the layer list models/ really builds: same layers, parameter counts as
DeepSpeed counts them (each layer built, trainable parameters summed), class names that DeepSpeed's
type:REGEX matches; and `profile` times those real layers."""

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import models  # noqa: E402
from toolkit.plan.arch import BUILTINS, to_hf_config  # noqa: E402
from toolkit.plan.costs import layer_costs  # noqa: E402
from toolkit.plan.partition import partition_layers  # noqa: E402
from toolkit.plan.profile import profile_layers, sample_batch  # noqa: E402


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
