"""A built-in model starts from the same random weights at every ZeRO stage (issue 31, item 18): ZeRO-3
partitions the model built as at ZeRO 0-2, so the first step's loss is the same. tiny-gpt2 and tiny-llama
on the corpus, seq 32, gbs 8, pp 1 x dp 2.
"""

import json
from pathlib import Path

import pytest

from tests.distributed.test_train import COMMON, OPTIMIZER, launch, losses

pytestmark = pytest.mark.distributed


def config(path: Path, dp: int, zero: int = 0) -> Path:
    """gbs 8 at pp 1: mbs 2 x gas (4 / dp) x dp."""
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // dp,
                                "gradient_clipping": 0.0, "optimizer": OPTIMIZER, "steps_per_print": 10**6,
                                "zero_optimization": {"stage": zero}}))
    return path


def train(tmp: Path, name: str, dp: int, *args, zero: int = 0, model_args=COMMON) -> Path:
    out = tmp / name
    rc, log = launch(config(tmp / f"{name}.json", dp, zero), out, dp, *args, model_args=model_args)
    assert rc == 0, log[-3000:]
    return out


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("tiny-gpt2", marks=pytest.mark.heavy)])
def test_a_builtin_model_starts_alike_at_zero0_and_zero3(model, tmp_path):
    args = [a if a != "tiny-gpt2" else model for a in COMMON] + ["--eval-fraction", "0", "--no-export"]
    first = [losses(train(tmp_path, f"zero{z}", 2, "--steps", 1, zero=z, model_args=args))[1] for z in (0, 3)]
    assert abs(first[0] - first[1]) <= 1e-6, first
