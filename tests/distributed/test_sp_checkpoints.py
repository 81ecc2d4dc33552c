"""Checkpoints of Ulysses sp runs (issue 28 item 5): export, resume on another sp, `dstk reshard --sp`.
CPU processes on gloo (tests/ranks.py), the built-in tiny Llama, fp32, clipping and dropout off, gbs 8
(mbs 2 x gas 4 * sp / ranks), warmup and decay as tests/distributed/test_resume_layouts.py.

A parameter does not depend on sp: an sp 2 run's exported HF model (ZeRO-1 and ZeRO-3, whose
partitions span dp x sp ranks) has the weights of one process's run (1e-5) and its eval loss through
from_pretrained. A run moved between sp 2 and sp 1 on the same 2 ranks (dp 1 <-> dp 2: ZeRO partitions and
each replica's rows change) continues by HF name (toolkit/checkpoint/portable.py) with the uninterrupted
run's losses (1e-4) and final weights (1e-5), as the layout moves of test_resume_layouts do; the same
from a folder `dstk reshard --sp` wrote offline. Inside pipeline stages (pp 2 x sp 2 on 4 ranks) the same:
its export is one process's model, and a run moves from it to sp 1 at pp 1, and from sp 1 into it.
"""

import json
from pathlib import Path

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, launch
from tests.distributed.test_resume_layouts import SCHEDULER, resumed_from
from tests.distributed.test_train import losses, summary

pytestmark = pytest.mark.distributed

TEXT = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0.05"]
STEPS, MOVE = 5, 3
RUNS = {  # name: ranks, sp, ZeRO stage, (run resumed from, at step MOVE) or None[, pipeline stages]
    "sp1": (1, 1, 1, None), "sp2z1": (2, 2, 1, None), "sp2z3": (2, 2, 3, None),
    "sp2_to_sp1": (2, 1, 1, "sp2z1"), "sp1_to_sp2": (2, 2, 3, "sp1"),
    "pp2sp2": (4, 2, 1, None, 2), "pp2sp2_to_sp1": (2, 1, 1, "pp2sp2"), "sp1_to_pp2sp2": (4, 2, 1, "sp1", 2)}


def config(path: Path, ranks: int, sp: int, zero: int, pp: int = 1) -> Path:
    return write_config(path, mbs=2, gas=4 * sp * pp // ranks, optimizer=OPTIMIZER, zero=zero, gradient_clipping=0.0,
                        scheduler=SCHEDULER, **({"sequence_parallel_size": sp} if sp > 1 else {}),
                        **({"pipeline": {"stages": pp}} if pp > 1 else {}), **QUIET)


class Runs:
    """Each run's folder, launched the first time a test asks for it (a fresh one exports to OUT/hf)."""

    def __init__(self, tmp: Path):
        self.tmp, self.done = tmp, set()

    def __truediv__(self, name: str) -> Path:
        if name not in self.done:
            ranks, sp, zero, source, *pp = RUNS[name]
            out = self.tmp / name
            if source is not None:
                resumed_from(self / source, MOVE, out)
            self.launch(name, out, ranks, sp, zero, resume=source is not None, pp=pp[0] if pp else 1)
            self.done.add(name)
        return self.tmp / name

    def launch(self, name: str, out: Path, ranks: int, sp: int, zero: int, resume: bool, pp: int = 1) -> None:
        rc, log = launch(config(self.tmp / f"{name}.json", ranks, sp, zero, pp), out, ranks, "--steps", STEPS,
                         "--save-every", MOVE, *(["--resume", "--no-export"] if resume else []), model_args=TEXT)
        assert rc == 0, f"{name}:\n{log[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("spckpt"))


def exported(out: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def final_weights(out: Path) -> dict:
    from toolkit.checkpoint.state import load_state_dict

    return load_state_dict(out / "checkpoints", f"global_step{STEPS}")[0]


def close(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        scale = max(want[k].abs().max().item(), 1e-12)
        # (a pipeline's ZeRO-1 fp32 masters come back flat, by name)
        assert (got[k].float().flatten() - want[k].float().flatten()).abs().max().item() <= rel * scale, k


def hf_eval_loss(out: Path) -> float:
    """The exported model's token-weighted cross entropy over the run's eval rows, prepared again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.reference import eval_reference
    from toolkit import data

    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    return eval_reference(model, data.prepare(data.DataOptions(path=str(CORPUS), seq_len=32, eval_fraction=0.05), tok).eval)


@pytest.mark.parametrize("name", ["sp2z1", pytest.param("sp2z3", marks=pytest.mark.heavy), "pp2sp2"])
def test_an_sp_run_exports_the_weights_of_one_process(runs, name):
    close(exported(runs / name), exported(runs / "sp1"))
    from toolkit.checkpoint.manifest import read_manifest

    record = read_manifest(runs / name / "checkpoints")
    assert (record["sp"], record["dp"], record["pp"]) == (2, 1, RUNS[name][4] if len(RUNS[name]) > 4 else 1)
    want = summary(runs / name)["eval_loss"]
    assert abs(hf_eval_loss(runs / name) - want) <= 1e-4 * want


@pytest.mark.parametrize("name, reference", [("sp2_to_sp1", "sp2z1"), ("sp1_to_sp2", "sp1"),
                                             ("pp2sp2_to_sp1", "pp2sp2"),
                                             pytest.param("sp1_to_pp2sp2", "sp1", marks=pytest.mark.heavy)])
def test_a_run_moved_to_another_sp_continues_as_if_uninterrupted(runs, name, reference):
    moved, want = losses(runs / name), losses(runs / reference)
    assert sorted(moved) == list(range(1, STEPS + 1))
    for step in range(MOVE + 1, STEPS + 1):
        assert abs(moved[step] - want[step]) <= 1e-4 * abs(want[step]), (name, step, moved, want)
    close(final_weights(runs / name), final_weights(runs / reference))
    layout = summary(runs / name)["run"]["layout"]
    ranks, sp, *_ = RUNS[name]
    pp = RUNS[name][4] if len(RUNS[name]) > 4 else 1
    assert (layout["sp"], layout["dp"], layout["pp"]) == (sp, ranks // sp // pp, pp)


def reshard(*args) -> dict:
    from click.testing import CliRunner

    from toolkit.cli.reshard import reshard as command

    result = CliRunner().invoke(command, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # (stderr: transformers' progress bars)


def test_reshard_moves_an_sp_run_to_sp_1_and_back_and_the_run_resumes_there(runs, tmp_path):
    import torch

    from toolkit.checkpoint import portable

    source = runs / "sp2z1"
    one = tmp_path / "sp1"
    done = reshard(source, one, "--sp", 1, "--dp", 2, "--tag", f"global_step{MOVE}")
    assert (done["from"]["sp"], done["from"]["dp"], done["to"]["sp"], done["to"]["dp"]) == (2, 1, 1, 2)
    back = reshard(one, tmp_path / "sp2", "--sp", 2, "--dp", 1)
    assert (back["to"]["sp"], back["to"]["dp"]) == (2, 1)
    want = portable.read(source / "checkpoints", f"global_step{MOVE}")
    got = portable.read(tmp_path / "sp2" / "checkpoints")
    assert got.optimizer_step == want.optimizer_step
    assert sorted(got.weights) == sorted(want.weights) and set(got.moments) == set(want.moments)
    assert all(torch.equal(got.weights[k].flatten(), want.weights[k].flatten()) for k in want.weights)
    assert all(torch.equal(got.moments[m][k].flatten(), want.moments[m][k].flatten())
               for m in want.moments for k in want.moments[m])
    # the resharded folder resumes at sp 1 on 2 ranks (dp 2) with the uninterrupted sp 2 run's losses
    keep_metrics(source, one)
    runs.launch("resharded", one, 2, 1, 1, resume=True)
    moved, reference = losses(one), losses(source)
    for step in range(MOVE + 1, STEPS + 1):
        assert abs(moved[step] - reference[step]) <= 1e-4 * abs(reference[step]), (step, moved, reference)


def keep_metrics(source: Path, out: Path) -> None:
    """The source run's steps up to MOVE, as a run resumed in place would have them."""
    lines = [line for line in (source / "metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line) and json.loads(line)["step"] <= MOVE]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_reshard_moves_an_sp_run_into_pipeline_stages_and_refuses_heads_it_does_not_divide(runs, tmp_path):
    from toolkit.checkpoint.reshard import reshard_checkpoint
    from toolkit.errors import ConfigError

    done = reshard_checkpoint(runs / "sp2z1", tmp_path / "pp2", pp=2, sp=2)
    assert (done["to"]["pp"], done["to"]["sp"], done["to"]["dp"]) == (2, 2, 1)
    with pytest.raises(ConfigError, match="--sp 3: sp 3 does not divide num_attention_heads 4"):
        reshard_checkpoint(runs / "sp2z1", tmp_path / "x", sp=3)
    with pytest.raises(ConfigError, match="--sp must be a positive integer"):
        reshard_checkpoint(runs / "sp2z1", tmp_path / "x", sp=0)
    assert not (tmp_path / "x").exists()
