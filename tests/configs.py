"""The DeepSpeed configs the tests train with, from one builder: mbs and gas, torch's AdamW, and keyword
overrides. (toolkit.config.generate.build_config writes the full config `dstk generate-config` ships: many
more keys than these runs want, so the tests do not use it for their small ones.)

    ds_config(2, 4, zero=1, pp=2, gradient_clipping=1.0)
    # {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "optimizer": adamw(1e-3),
    #  "zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}, "gradient_clipping": 1.0}
"""

import json
from pathlib import Path

QUIET = {"steps_per_print": 10**6}  # DeepSpeed's own step lines off
# --eval-fraction of the runs that evaluate without checking the eval loss: ceil(700 x 0.005) = 4 of the
# corpus's documents, a few micro-batches at --seq-len 32 (the run evaluates its whole eval split; the
# default 5% is ~190 micro-batches of 2 rows, most of a short test run's time).
SHORT_EVAL = 0.005
FULL_ADAMW = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # torch's defaults, written out


def adamw(lr: float = 1e-3, **params) -> dict:
    """DeepSpeed's "AdamW" optimizer entry, run as torch's AdamW (torch_adam: no JIT build)."""
    return {"type": "AdamW", "params": {"lr": lr, **params, "torch_adam": True}}


def ds_config(mbs: int = 2, gas: int = 1, *, lr: float = 1e-3, optimizer: dict | None = None, zero: int | None = None,
              pp: int | None = None, tp: int = 1, bf16: bool | None = None, **keys) -> dict:
    """A DeepSpeed config: mbs, gas and the optimizer (adamw(lr) unless `optimizer`); zero, pp, tp (when > 1)
    and bf16 fill their sections; `keys` are DeepSpeed keys as written (gradient_clipping=1.0, **QUIET, ...)."""
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
           "optimizer": adamw(lr) if optimizer is None else optimizer}
    if zero is not None:
        cfg["zero_optimization"] = {"stage": zero}
    if pp is not None:
        cfg["pipeline"] = {"stages": pp}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if bf16 is not None:
        cfg["bf16"] = {"enabled": bf16}
    return {**cfg, **keys}


OPTIMIZER = adamw(1e-3, **FULL_ADAMW)  # the distributed runs' optimizer


def run_config(mbs: int, gas: int, pp: int, lr: float = 1e-3, clip: float = 0.0, **pipeline) -> dict:
    """The session's tiny-gpt2 runs (tests/runs.py train_runs, test_train, test_pipeline_training, ...): fp32,
    OPTIMIZER at `lr`, gradient_clipping `clip`, `pp` pipeline stages (`pipeline`: more of that section)."""
    return ds_config(mbs, gas, optimizer=adamw(lr, **FULL_ADAMW), gradient_clipping=clip,
                     pipeline={"stages": pp, **pipeline}, **QUIET)


def write_config(path: Path, cfg: dict | None = None, **kwargs) -> Path:
    """`cfg` (else ds_config(**kwargs)) written as JSON to `path`; returns `path`."""
    path.write_text(json.dumps(ds_config(**kwargs) if cfg is None else cfg))
    return path
