"""bf16 runs resume, move and export alike at every layout DeepSpeed allows (issue 31, items 1-3): pp 1 x dp 2
at ZeRO 0-3 and pp 2 x dp 1 at ZeRO 0-1, with the configs dstk writes for bf16 (ZeRO >= 1: fp32 gradient
accumulation, as generate-config writes it; ZeRO-0: bf16 accumulation, the only kind DeepSpeed takes there).

Each layout's uninterrupted run (6 steps, checkpoints at steps 3 and 6, the export at the end) is the
reference for three cells:
- same layout: resumed at step 3 on its own layout, steps 4-6 give its losses (1e-3 relative);
- move: resumed at step 3 on another layout (a ring through all six: each one a source once and a target
  once), steps 4-6 give the source's losses within bf16 noise (2e-3 relative; seen <= 8e-5);
- export: the HF directory (streamed) holds the fp32 masters, exactly as toolkit.checkpoint.state reads them whole,
  off the bf16 grid.
The default tier runs what was broken, chained from one reference (pp 2 ZeRO-0, BF16_Optimizer): its own
resume (item 1: DeepSpeed's load failed), a move onto pp 1 ZeRO-0 (item 2: FP16_UnfusedOptimizer's fp32
masters were not restored), and from that run's step 4 a move onto pp 1 ZeRO-1 (reading
FP16_UnfusedOptimizer's state, refused before; BF16_Optimizer at pp 1, whose masters only dstk reads by
name). The rest of the matrix is heavy. tiny-llama on the corpus, seq 32, gbs 8 (mbs 2 x gas 4/dp x dp),
AdamW lr 3e-3 with weight decay 0.01, no clipping, no dropout.
"""

from pathlib import Path

import pytest

from tests.configs import QUIET, adamw, write_config
from tests.distributed.test_resume_layouts import resumed_from
from tests.distributed.launch import CORPUS, launch
from tests.distributed.test_train import losses
from tests.unit.test_export_stream import read_weights

pytestmark = pytest.mark.distributed

LAYOUTS = {"pp1z0": (1, 0), "pp1z1": (1, 1), "pp1z2": (1, 2), "pp1z3": (1, 3), "pp2z0": (2, 0), "pp2z1": (2, 1)}
RING = {"pp1z0": "pp2z0", "pp2z1": "pp1z0", "pp1z3": "pp2z1", "pp1z2": "pp1z3", "pp1z1": "pp1z2", "pp2z0": "pp1z1"}
MODEL = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0"]
STEPS, AT = 6, 3
SAME, MOVED = 1e-3, 2e-3  # relative: a resume on its own layout; bf16 noise across layouts
DEFAULT_TIER = ("pp2z0",)  # its own resume (item 1) and export
DEFAULT_MOVE = "pp1z0"  # from pp2z0 (item 2); the chained test below moves that run on


def config(path: Path, name: str) -> Path:
    pp, zero = LAYOUTS[name]
    fp32_accumulation = {"data_types": {"grad_accum_dtype": "fp32"}} if zero else {}
    return write_config(path, mbs=2, gas=2 * pp, optimizer=adamw(3e-3, weight_decay=0.01), zero=zero, pp=pp,
                        bf16=True, gradient_clipping=0.0, **QUIET, **fp32_accumulation)


class Matrix:
    """The runs of this file, each launched the first time a test asks for it (2 ranks, ~10-20 s)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def reference(self, name: str) -> Path:
        return self._run(name, name)

    def resumed(self, name: str, source: Path, at: int = AT) -> Path:
        """`source` resumed from its step `at` on layout `name`, to step 6, a checkpoint every step."""
        return self._run(f"{source.name}@{at}-{name}", name, (source, at), every=1)

    def _run(self, label: str, name: str, resume_from=None, every: int = AT) -> Path:
        out = self.folder / label
        if not (out / "hf").is_dir():
            if resume_from is not None:
                resumed_from(*resume_from, out)
            rc, log = launch(config(self.folder / f"{label}.json", name), out, 2, "--steps", STEPS, "--save-every",
                             every, *(["--resume"] if resume_from else []), model_args=MODEL)
            assert rc == 0, log[-3000:]
        return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("bf16_matrix"))


def heavy_unless(*default):
    return [pytest.param(name, marks=[] if name in default else pytest.mark.heavy) for name in LAYOUTS]


def continues(run: Path, reference: Path, steps, rel: float) -> None:
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))  # the steps before the resume kept, each step once
    for step in steps:
        assert abs(got[step] - want[step]) <= rel * want[step], (run.name, step, got, want)


def exports_the_masters(run: Path) -> None:
    """OUT/hf (streamed by the run's export) = the fp32 masters toolkit.checkpoint.state reads whole, off the bf16 grid."""
    import torch

    from toolkit.checkpoint.state import load_state_dict

    exported = read_weights(run / "hf")
    masters, _ = load_state_dict(run / "checkpoints", f"global_step{STEPS}")
    assert set(exported) <= set(masters) and len(exported) >= 30
    for name, w in exported.items():
        assert w.dtype == torch.float32 and torch.equal(w.flatten(), masters[name].flatten()), name  # pp 2: flat
        if w.dim() == 2 and "embed" not in name:  # an embedding's rows move only for the bytes seen
            assert (w.bfloat16().float() != w).float().mean() > 0.5, name


@pytest.mark.parametrize("name", heavy_unless(*DEFAULT_TIER))
def test_a_bf16_run_resumed_on_its_layout_continues_it(matrix, name):
    reference = matrix.reference(name)
    continues(matrix.resumed(name, reference), reference, range(AT + 1, STEPS + 1), SAME)


@pytest.mark.parametrize("name", heavy_unless(DEFAULT_MOVE))
def test_a_bf16_run_moved_to_another_layout_continues_it(matrix, name):
    reference = matrix.reference(RING[name])
    moved = matrix.resumed(name, reference)
    continues(moved, reference, range(AT + 1, STEPS + 1), MOVED)
    exports_the_masters(moved)


@pytest.mark.parametrize("name", heavy_unless(*DEFAULT_TIER))
def test_a_bf16_run_exports_its_fp32_masters(matrix, name):
    exports_the_masters(matrix.reference(name))


def test_a_bf16_run_moves_across_optimizer_wrappers_and_back(matrix):
    """pp 2 ZeRO-0 (BF16_Optimizer) -> pp 1 ZeRO-0 (FP16_UnfusedOptimizer: its masters and Adam's state)
    at step 3, and that run's step 4 -> pp 1 ZeRO-1 (BF16_Optimizer at pp 1, fp32 accumulation): steps 5-6
    continue the reference, and the export holds the masters read by name."""
    reference = matrix.reference(RING[DEFAULT_MOVE])
    onto_zero0 = matrix.resumed(DEFAULT_MOVE, reference)  # test_a_bf16_run_moved_...[pp1z0]'s run
    onto_zero1 = matrix.resumed("pp1z1", onto_zero0, at=AT + 1)
    continues(onto_zero1, reference, range(AT + 2, STEPS + 1), MOVED)
    exports_the_masters(onto_zero1)
