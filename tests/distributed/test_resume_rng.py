"""Random numbers across a resume (issue 31, items 17 and 18), tiny-gpt2 on the corpus, seq 32, gbs 8.

- Dropout (here LoRA's, --lora-dropout 0.1) draws from torch's generator: each rank saves its generators
  beside its checkpoint (rng_state_<rank>.pt), so a run resumed on its own layout continues the
  uninterrupted run's losses to the bit; on another layout the ranks differ, and each replica re-seeds
  from (--seed, step, dp rank): two such moves give the same losses.
- A built-in model starts from the same random weights at every ZeRO stage (ZeRO-3 partitions the
  model built as at ZeRO 0-2), so the first step's loss is the same.
"""

from pathlib import Path

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.test_resume_layouts import resumed_from
from tests.distributed.launch import COMMON, launch
from tests.distributed.test_train import losses

pytestmark = pytest.mark.distributed

DROPOUT = [*COMMON, "--lora", "--lora-r", "4", "--lora-dropout", "0.1", "--eval-fraction", "0", "--no-export"]


def config(path: Path, dp: int, zero: int = 0, pp: int = 1) -> Path:
    """gbs 8: mbs 2 x gas (4 / dp) x dp."""
    return write_config(path, mbs=2, gas=4 // dp, optimizer=OPTIMIZER, zero=zero, pp=pp, gradient_clipping=0.0,
                        **QUIET)


def train(tmp: Path, name: str, dp: int, *args, zero: int = 0, pp: int = 1, model_args=DROPOUT) -> Path:
    out = tmp / name
    rc, log = launch(config(tmp / f"{name}.json", dp, zero, pp), out, pp * dp, *args, model_args=model_args)
    assert rc == 0, log[-3000:]
    return out


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory):
    """(pp, dp) -> 5 steps with LoRA dropout on 2 ranks, a checkpoint at step 3 (and 5); made on first use."""
    tmp, made = tmp_path_factory.mktemp("rng"), {}

    def get(pp: int, dp: int) -> Path:
        if (pp, dp) not in made:
            made[pp, dp] = train(tmp, f"pp{pp}dp{dp}", dp, "--steps", 5, "--save-every", 3, pp=pp)
        return made[pp, dp]
    return get


@pytest.mark.parametrize("pp, dp", [(1, 2), (2, 1)])
def test_a_dropout_run_resumed_on_its_layout_continues_exactly(dropout_runs, tmp_path, pp, dp):
    whole = dropout_runs(pp, dp)
    out = resumed_from(whole, 3, tmp_path / "resumed")
    rc, log = launch(config(tmp_path / "ds.json", dp, pp=pp), out, 2, "--steps", 5, "--resume", model_args=DROPOUT)
    assert rc == 0, log[-3000:]
    want, got = losses(whole), losses(out)
    assert all(abs(got[s] - want[s]) <= 1e-6 for s in (4, 5)), (got, want)
    assert sorted(p.name for p in (out / "checkpoints" / "global_step3").glob("rng_state_*.pt")) == [
        "rng_state_0.pt", "rng_state_1.pt"]  # one per rank: DeepSpeed keeps dp rank 0's client state only


def test_a_dropout_run_moved_to_another_layout_reseeds_alike_each_time(dropout_runs, tmp_path):
    """pp 1 x dp 2 -> dp 1: the saved states are the old layout's ranks' (rank 0's file is there, but
    for another replica size), so rank 0 re-seeds from (--seed, step 3, dp rank 0): the same losses
    with those files and without them."""
    moved = []
    for name in ("with_files", "without_files"):
        out = resumed_from(dropout_runs(1, 2), 3, tmp_path / name)
        if name == "without_files":  # as an older dstk wrote it: no RNG files, and no list of the tag's files
            for path in (out / "checkpoints" / "global_step3").glob("rng_state_*.pt"):
                path.unlink()
            (out / "checkpoints" / "global_step3" / "dstk-files.json").unlink()
        rc, log = launch(config(tmp_path / "dp1.json", 1), out, 1, "--steps", 5, "--resume", model_args=DROPOUT)
        assert rc == 0, log[-3000:]
        moved.append(losses(out))
    want = losses(dropout_runs(1, 2))
    assert moved[0] == moved[1]
    assert all(abs(moved[0][s] - want[s]) <= 1e-2 * want[s] for s in (4, 5)), (moved[0], want)  # dropout's noise


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("tiny-gpt2", marks=pytest.mark.heavy)])
def test_a_builtin_model_starts_alike_at_zero0_and_zero3(model, tmp_path):
    args = [a if a != "tiny-gpt2" else model for a in COMMON] + ["--eval-fraction", "0", "--no-export"]
    first = [losses(train(tmp_path, f"zero{z}", 2, "--steps", 1, zero=z, model_args=args))[1] for z in (0, 3)]
    assert abs(first[0] - first[1]) <= 1e-6, first
