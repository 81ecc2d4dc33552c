"""`dstk train --tiled-loss on` against the same run with the whole logits (--tiled-loss off): the same losses,
gradient norms and eval loss (1e-5, fp32) on CPU ranks forked from the warm rank server, the built-in tiny Llama
(untied head) and tiny GPT-2 (tied: the head is the embedding's weight, on the first stage's tied copy). Packed
text at pp 1 and pp 2 (1F1B), chat rows with assistant-only labels and LoRA at pp 1, sp 2 (sp's shifted labels and
token counts) and pp 2 x sp 2 (4 ranks), dp 2 under ZeRO-2 (the head's gradient bucketed once, after the last
tile) and under ZeRO-3 (the head's weight partitioned; tests/unit/test_tiled_loss.py runs several tiles there); a
tiled pp 2 run resumed from step 3 continues the losses. The default tier
holds pp 1 and pp 2; the rest is heavy."""

import json
from pathlib import Path

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, LazyRuns
from tests.distributed.test_train import losses, summary

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TEXT = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0.05"]
GPT2 = ["--model", "tiny-gpt2", *TEXT[2:]]
CHAT = ["--model", "tiny-llama", "--data", str(REPO / "toolkit" / "corpus" / "chat.jsonl"), "--chat-template",
        str(REPO / "toolkit" / "corpus" / "chatml.jinja"), "--seq-len", "160", "--no-progress", "--eval-fraction",
        "0.1", "--lora", "--lora-r", "4", "--train-on", "assistant"]
LAYOUTS = {  # processes, pp, sp, model arguments[, ZeRO stage: 1 else]
    "pp1": (1, 1, 1, TEXT), "pp2": (2, 2, 1, TEXT), "gpt2_pp2": (2, 2, 1, GPT2), "chat_pp1": (1, 1, 1, CHAT),
    "sp2": (2, 1, 2, TEXT), "pp2sp2": (4, 2, 2, TEXT), "zero3": (2, 1, 1, TEXT, 3), "zero2": (2, 1, 1, GPT2, 2)}
STEPS = 6


class Runs(LazyRuns):
    """NAME_on / NAME_off: layout NAME with --tiled-loss on / off, launched when a test first asks;
    NAME_on_resumed: NAME_on resumed from its step 3."""

    def _launch(self, name: str) -> None:
        layout, mode = name.removesuffix("_resumed").rsplit("_", 1)
        procs, pp, sp, args, *zero = LAYOUTS[layout]
        cfg = write_config(self.tmp / f"{layout}.json", mbs=2, gas=4 * sp * pp // procs, optimizer=OPTIMIZER,
                           zero=zero[0] if zero else 1,
                           pp=pp if pp > 1 else None, gradient_clipping=1.0,
                           **({"sequence_parallel_size": sp} if sp > 1 else {}), **QUIET)
        self.launch_run(name, cfg, procs, ["--steps", STEPS, "--save-every", 3, "--no-export", "--tiled-loss", mode], args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("tiled"))


def records(out: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r}


def assert_same(got: Path, want: Path, rel: float = 1e-5):
    a, b = records(got), records(want)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert all(abs(a[s][key] - b[s][key]) <= rel * abs(b[s][key]) for s in b), (key, a, b)
    assert abs(summary(got)["eval_loss"] - summary(want)["eval_loss"]) <= rel * abs(summary(want)["eval_loss"])


LIGHT = ["pp1", "pp2", "gpt2_pp2"]
HEAVY = [pytest.param(name, marks=pytest.mark.heavy) for name in ("chat_pp1", "sp2", "pp2sp2", "zero2", "zero3")]


@pytest.mark.parametrize("layout", LIGHT + HEAVY)
def test_the_tiled_loss_trains_as_the_whole_logits_do(runs, layout):
    assert_same(runs / f"{layout}_on", runs / f"{layout}_off")
    log = (runs.tmp / f"{layout}_on.log").read_text()
    assert "loss: tiled, the logits never whole (--tiled-loss on;" in log, log[-3000:]


def test_a_resumed_tiled_pipeline_continues_the_losses(runs):
    want, got = losses(runs / "pp2_on"), losses(runs / "pp2_on_resumed")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in range(4, STEPS + 1)), (got, want)

