"""Model FLOPs utilisation: the FLOPs a run's tokens needed, by the planner's cost model, over what its
GPUs could have done at their dense peak (the preset table in toolkit.plan.gpus).

    MFU = tokens/s x training FLOPs per token / (GPUs x peak FLOP/s of the run's precision)

Training FLOPs per token: toolkit.plan.cost.layers.layer_costs' forward + backward FLOPs of one sequence over
its tokens, that is 6N for the weights a token multiplies (N: the blocks' and the head's matrices; the
embedding is a lookup), plus 12 L s h_attn for QK^T and P@V over the whole s x s matrix (PaLM's
convention: the causal half that flash kernels skip is counted), plus small elementwise terms (norms,
softmax, activation; under 1% at seq 2048). LoRA: a frozen weight skips its weight gradient (4N instead
of 6N) and the adapters add theirs. Nothing here imports torch.
"""

from toolkit.errors import ConfigError
from toolkit.plan.arch import Arch
from toolkit.plan.cost.layers import layer_costs
from toolkit.plan.gpus import get_gpu, preset_for_device


def flops_per_token(arch: Arch, seq_len: int, lora: int | None = None) -> float:
    """Forward + backward FLOPs per trained token of a causal LM at `seq_len` (LoRA rank `lora`, or all trained)."""
    return sum(c.flops for c in layer_costs(arch, seq_len, 1, lora=lora)) / seq_len


def peak_tflops(device_name: str, precision: str) -> tuple[str, float]:
    """(preset, dense peak TFLOPs of `precision`) for a CUDA device name; a ConfigError saying why not."""
    preset = preset_for_device(device_name)
    if preset is None:
        raise ConfigError(f"{device_name!r} has no preset in toolkit.plan.gpus (its peak is not guessed)")
    return preset, get_gpu(preset).tflops(precision)


def utilisation(tokens_per_s: float, flops: float, gpus: int, tflops: float) -> float:
    """Share of `gpus` GPUs' peak (`tflops` each) that `tokens_per_s` tokens of `flops` FLOPs each used."""
    return tokens_per_s * flops / (gpus * tflops * 1e12)
