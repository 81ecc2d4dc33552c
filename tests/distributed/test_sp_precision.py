"""sp 2 (Ulysses, pp 1) in bf16 at every ZeRO stage, and in fp16, on the configs `dstk generate-config` writes
(gradient clipping 1.0: every rank's norm steers its update): real ranks on gloo (tests/ranks.py), the built-in
tiny Llama on packed text.

DeepSpeed's parallel_state_sp names the sp rank its model-parallel rank; BF16_Optimizer (bf16 with fp32
gradient accumulation at ZeRO 1: `dstk generate-config --sp 2 --bf16`) then kept no gradient for the norm on
sp rank 1 and stopped at step 1 ("stack expects a non-empty TensorList"), fresh, at dp 2 x sp 2, or moved onto
sp 2. dstk's mpu (toolkit.distributed.sequence_parallel.UlyssesGroups) makes every rank model-parallel rank 0
of one: each run here gives one process's losses (1e-4, as tests/distributed/test_sequence_parallel.py) and
grad norms (NORM_REL), every rank's engine computes the same norm (all its sp ranks hold the whole all-reduced
gradient), and the opening block names the layout, sp included.
"""

import pytest

from tests.distributed.launch import CORPUS, launch
from tests.distributed.test_resume_layouts import resumed_from
from tests.distributed.test_sequence_parallel import records
from tests.invoke import invoke_dstk
from tests.ranks import run_ranks

pytestmark = pytest.mark.distributed

TEXT = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0",
        "--no-export"]
STEPS = 4
LOSS_REL = 1e-4  # measured: 2.4e-5 at most (bf16, ZeRO 0-3)
# bf16: each sp rank rounds its share of a gradient to bf16 before the shares are summed, where one process rounds
# the sum: norms measured within 5.8e-4 of one process's (ZeRO 0-3), fp16 within 1.2e-4
NORM_REL = 2e-3
SCRIPTS = CORPUS.parents[2] / "tests" / "distributed" / "scripts"
FP16_STAND_IN, RANK_NORMS = SCRIPTS / "fp16_stand_in.py", SCRIPTS / "rank_grad_norms.py"


def generated(tmp, name: str, procs: int, sp: int, zero: int, precision: str):
    """`dstk generate-config` for `procs` ranks at sp, ZeRO `zero`, in `precision`, 8 rows a step (mbs 2)."""
    path = tmp / f"{name}.json"
    fp16 = ["--initial-scale-power", 8] if precision == "fp16" else []
    ran = invoke_dstk(["generate-config", "--world-size", procs, "--sp", sp, "--zero", zero, "--precision", precision,
                       "--mbs", 2, "--gbs", 8, "--lr", "1e-3", *fp16, "-o", path])
    assert ran.returncode == 0, ran.stderr
    return path


def train(tmp, name: str, procs: int, sp: int, zero: int, precision: str = "bf16", *args) -> tuple:
    """(metrics by step, output) of a run; on several ranks each also prints its own grad norm (RANK_NORMS)."""
    cfg = generated(tmp, name, procs, sp, zero, precision)
    script = FP16_STAND_IN if precision == "fp16" else RANK_NORMS  # fp16: a stand-in for a GPU's fp16 support
    if procs > 1 or precision == "fp16":
        rc, log = run_ranks([script, "--config", cfg, *TEXT, "--out", tmp / name, "--steps", STEPS, *args], procs)
    else:
        rc, log = launch(cfg, tmp / name, procs, "--steps", STEPS, *args, model_args=TEXT)
    assert rc == 0, f"{name}:\n{log[-4000:]}"
    return records(tmp / name), log


def rank_norms(log: str, procs: int) -> list:
    """Each step's grad norms as each rank's engine computed them (rank_grad_norms.py's lines), rank by rank."""
    found = [line.split() for line in log.splitlines() if " grad norm " in line and line.startswith("rank ")]
    return [[float(w[-1]) for w in found if w[1] == str(rank)] for rank in range(procs)]


def agree(got: dict, want: dict, key: str, rel: float, steps=None) -> bool:
    steps = sorted(want) if steps is None else steps
    return all(abs(got[s][key] - want[s][key]) <= rel * abs(want[s][key]) for s in steps)


def same_run(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert want[1]["grad_norm"] > 1.0  # clipping acts: a rank with another norm would take another step
    assert agree(got, want, "loss", LOSS_REL), (got, want)
    assert agree(got, want, "grad_norm", NORM_REL), (got, want)


@pytest.mark.parametrize("zero", [1, pytest.param(0, marks=pytest.mark.heavy), pytest.param(2, marks=pytest.mark.heavy),
                                  pytest.param(3, marks=pytest.mark.heavy)])
def test_sp2_bf16_gives_one_process_losses_and_grad_norms_at_every_zero_stage(tmp_path, zero):
    want, _ = train(tmp_path, "one", 1, 1, zero)
    got, log = train(tmp_path, "sp2", 2, 2, zero)
    same_run(got, want)
    norms = rank_norms(log, 2)  # the sp ranks hold the same all-reduced gradient: each rank's own norm is the norm
    assert len(norms[0]) == STEPS and norms[0] == norms[1], norms
    assert "layout: dp 1 x pp 1 x tp 1 x sp 2 = 2 ranks, ZeRO" in log, log[-3000:]


@pytest.mark.heavy
def test_dp2_sp2_bf16_zero1_gives_one_process_losses_and_grad_norms(tmp_path):
    want, _ = train(tmp_path, "one", 1, 1, 1)
    got, log = train(tmp_path, "dp2sp2", 4, 2, 1)
    same_run(got, want)
    norms = rank_norms(log, 4)
    assert len(norms[0]) == STEPS and all(n == norms[0] for n in norms), norms
    assert "layout: dp 2 x pp 1 x tp 1 x sp 2 = 4 ranks, ZeRO 1" in log, log[-3000:]


@pytest.mark.heavy
def test_a_bf16_zero1_run_moved_onto_sp2_trains_on(tmp_path):
    """One process saves at step 2; the run resumed from there on sp 2 (a move: portable) continues its losses."""
    want, _ = train(tmp_path, "one", 1, 1, 1, "bf16", "--save-every", 2)
    resumed_from(tmp_path / "one", 2, tmp_path / "moved")
    got, _ = train(tmp_path, "moved", 2, 2, 1, "bf16", "--resume")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert agree(got, want, "loss", LOSS_REL, steps=[3, 4]) and agree(got, want, "grad_norm", NORM_REL, steps=[3, 4])


@pytest.mark.heavy
@pytest.mark.parametrize("zero", [0, 1])
def test_sp2_fp16_gives_one_process_losses_and_grad_norms(tmp_path, zero):
    """fp16 goes through FP16_UnfusedOptimizer (ZeRO 0) and DeepSpeed's ZeRO optimizer (ZeRO 1), not
    BF16_Optimizer; the first reads the same mpu for its norm and its overflow check."""
    want, _ = train(tmp_path, "one", 1, 1, zero, "fp16")
    got, _ = train(tmp_path, "sp2", 2, 2, zero, "fp16")
    same_run(got, want)


@pytest.mark.heavy
def test_the_sp_flag_splits_the_sequence_of_a_config_that_does_not_say(tmp_path):
    """`dstk train --sp 2` with one process's config (mbs 2 x gas 4 = 8 rows): the layout's dp is world / sp, and
    the run is one process's run, as with "sequence_parallel_size": 2 in the file."""
    want, _ = train(tmp_path, "one", 1, 1, 1)
    rc, log = run_ranks([RANK_NORMS, "--config", tmp_path / "one.json", *TEXT, "--out", tmp_path / "flag", "--steps",
                         STEPS, "--sp", 2], 2)
    assert rc == 0, log[-4000:]
    same_run(records(tmp_path / "flag"), want)
    assert "layout: dp 1 x pp 1 x tp 1 x sp 2 = 2 ranks, ZeRO 1" in log, log[-3000:]
