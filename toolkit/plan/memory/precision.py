"""Bytes per element by training precision and optimizer: the one table that the cost model
(cost/layers.py), the memory model (memory/rank.py) and the planner (layouts/estimate.py) read.

Mixed precision (bf16/fp16) keeps the model's parameters, gradients and activations in 2 bytes and
an fp32 master copy of each parameter beside the optimizer states; fp32 keeps everything in 4.
"""

from dataclasses import dataclass

from toolkit.errors import ConfigError

FP32 = 4
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # a parameter, a gradient, an activation element
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4}  # fp32 exp_avg + exp_avg_sq; SGD momentum


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per activation element."""

    param: int
    grad: int
    optim: int  # optimizer states, plus the fp32 master copy (4) under mixed precision
    act: int


def weight_bytes(precision: str) -> int:
    """Bytes of one parameter (gradient, activation element) in the model under `precision`."""
    if precision not in WEIGHT_BYTES:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(WEIGHT_BYTES)}")
    return WEIGHT_BYTES[precision]


def optimizer_bytes(optimizer: str) -> int:
    """Bytes of optimizer state per parameter (fp32)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(f"optimizer {optimizer!r} unknown; use one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    return OPTIMIZER_STATE_BYTES[optimizer]


def precision_bytes(precision: str, optimizer: str = "adam") -> Precision:
    w = weight_bytes(precision)
    return Precision(w, w, optimizer_bytes(optimizer) + (FP32 if w != FP32 else 0), w)


PRECISIONS = {name: precision_bytes(name) for name in WEIGHT_BYTES}
