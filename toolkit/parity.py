"""Does the wrapped model compute what the HF model computes? (library side of `dstk parity`)

    dstk parity llama            # a model type: small random weights
    dstk parity path/to/hf_dir   # a local HF directory (full model in this process)

The layer list runs as a real single-stage deepspeed PipelineModule in a gloo world of one; the
HF model shares its parameters with it, so gradients are compared parameter by parameter.
Batches are (B, T) with right padding in one row (pad=True) so the padding mask is exercised.
"""

import os
from dataclasses import dataclass

from toolkit.errors import ConfigError, UnusableInput

TOLERANCE = 1e-5  # max abs difference allowed in fp32
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)


@dataclass
class ParityReport:
    """Max abs differences between the HF model and its pipeline layer list."""

    model: str
    task: str
    num_layers: int
    loss_hf: float
    loss_diff: float
    logits_diff: float
    grad_diff: float
    grad_name: str  # the parameter with the largest gradient difference
    params_checked: int

    @property
    def ok(self) -> bool:
        return max(self.loss_diff, self.logits_diff, self.grad_diff) <= TOLERANCE


def no_dropout(config):
    """Set every dropout probability in `config` to 0 (in place): dropout makes runs differ."""
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    return config


def small_model(model_type: str, task=None, seed: int = 0, **overrides):
    """A HF model of `model_type` with SMALL dimensions and random weights (fp32, no dropout)."""
    import torch
    from transformers import AutoConfig

    from models.api import _auto_class, _default_task

    try:
        config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    except ValueError:
        raise ConfigError(f"unknown model {model_type!r}: not a local directory nor a transformers "
                          "model_type (try llama, gpt2, bert, qwen2, mistral, gemma, phi3)") from None
    no_dropout(config)
    task = task or _default_task(config)
    torch.manual_seed(seed)
    return _auto_class(task, config).from_config(config).float().eval()


def load_model(path: str, task=None):
    """The full HF model saved at `path`, fp32, dropout off."""
    from transformers import AutoConfig

    from models.api import _auto_class, _default_task

    if not os.path.isdir(path):
        raise UnusableInput(f"{path}: no such directory")
    config = no_dropout(AutoConfig.from_pretrained(path))
    return _auto_class(task or _default_task(config), config).from_pretrained(path, config=config).float().eval()


def batch(config, task, batch_size=2, seq_len=8, pad=True, seed=0):
    """(inputs, labels) as the pipeline's data iterator yields them; row 0 right-padded by 3 if pad."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if pad:
        mask[0, -3:] = 0
    if task == "sequence-classification":
        labels = torch.randint(0, config.num_labels, (batch_size,), generator=g)
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return (ids, mask), labels
