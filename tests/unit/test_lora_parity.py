"""LoRA through the pipeline wrappers: the layer list of a PEFT-wrapped model, run as a real
single-stage PipelineModule, computes the PeftModel's loss, logits and adapter gradients (fp32, 1e-5).

lora_B starts at zero in PEFT (so lora_A's gradient would be zero too and prove nothing): the test
draws both matrices at random first, so every adapter changes the output and gets a gradient.
"""

import pytest
import torch

from models.lora import adapters
from toolkit.train.parity import TOLERANCE, check_model, small_model

CASES = [("llama", "causal-lm"), ("gpt2", "causal-lm"), ("bert", "sequence-classification"),
         ("qwen2", "causal-lm"), ("mistral", "causal-lm")]


def _peft(model_type: str, task: str):
    model = small_model(model_type, task, attn_implementation="eager",
                        **({"num_labels": 3} if task == "sequence-classification" else {}))
    wrapped = adapters.apply(model, adapters.LoraSettings(r=4), "classification" if task == "sequence-classification"
                         else "causal-lm", seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return wrapped.eval()


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("model_type, task", CASES, ids=[c[0] for c in CASES])
def test_lora_layers_compute_the_peft_model(ds_world1, model_type, task, pad):
    wrapped = _peft(model_type, task)
    report = check_model(wrapped.base_model.model, name=model_type, task=task, pad=pad, reference=wrapped)
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all(adapters.is_adapter(n) for n in trainable)  # the base is frozen
    assert report.params_checked == len(trainable)  # every adapter's gradient compared, nothing else has one
    assert report.ok, report
    assert report.loss_diff <= TOLERANCE and report.grad_diff <= TOLERANCE
