"""`dstk train --tiled-mlp on` against the same run with whole MLPs (--tiled-mlp off): the same losses, gradient
norms and eval loss (1e-5, fp32) on CPU ranks forked from the warm rank server, the built-in tiny Llama (hidden 64:
rows of 128 tokens, 2 a micro-batch, are 4 shards of 64 tokens per MLP call). Packed text at pp 1 and pp 2 (1F1B);
heavy: ZeRO-2 and ZeRO-3 over 2 ranks, ZeRO-3 with every weight partitioned (each shard gathers the MLP's weights;
ZeRO's buckets take a gradient once, after the last shard), activation checkpointing at pp 1 (HF's) and pp 2 (the pipeline's), chat rows
with assistant-only labels and LoRA on the MLP's linears among others, sp 2 (2 shards of a rank's 128 tokens) and
pp 2 x sp 2 (4 ranks). A tiled pp 2 run resumed from step 3 continues the losses."""

from pathlib import Path

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, LazyRuns
from tests.distributed.test_tiled_loss_runs import STEPS, assert_same
from tests.distributed.test_train import losses

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TEXT = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "128", "--no-progress", "--eval-fraction", "0.05"]
CHAT = ["--model", "tiny-llama", "--data", str(REPO / "toolkit" / "corpus" / "chat.jsonl"), "--chat-template",
        str(REPO / "toolkit" / "corpus" / "chatml.jinja"), "--seq-len", "160", "--no-progress", "--eval-fraction",
        "0.1", "--lora", "--lora-r", "4", "--train-on", "assistant"]
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # tiny weights are otherwise never partitioned
LAYOUTS = {  # processes, pp, sp, model arguments, config keys, shards per MLP call
    "pp1": (1, 1, 1, TEXT, {}, 4), "pp2": (2, 2, 1, TEXT, {}, 4),
    "zero2_dp2": (2, 1, 1, TEXT, {"zero_optimization": {"stage": 2}}, 4),
    "zero3_dp2": (2, 1, 1, TEXT, {"zero_optimization": ZERO3}, 4),
    "ckpt_pp1": (1, 1, 1, TEXT, {"activation_checkpointing": {}}, 4),
    "ckpt_pp2": (2, 2, 1, TEXT, {"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}, 4),
    "chat_pp1": (1, 1, 1, CHAT, {}, 5), "sp2": (2, 1, 2, TEXT, {}, 2), "pp2sp2": (4, 2, 2, TEXT, {}, 2)}


class Runs(LazyRuns):
    """NAME_on / NAME_off: layout NAME with --tiled-mlp on / off, launched when a test first asks;
    NAME_on_resumed: NAME_on resumed from its step 3."""

    def _launch(self, name: str) -> None:
        layout, mode = name.removesuffix("_resumed").rsplit("_", 1)
        procs, pp, sp, args, keys, _ = LAYOUTS[layout]
        dp = procs // (pp * sp)
        keys = {"zero_optimization": {"stage": 1}, **keys}
        cfg = write_config(self.tmp / f"{layout}.json", mbs=2, gas=4 // dp, optimizer=OPTIMIZER,
                           pp=pp if pp > 1 and "pipeline" not in keys else None, gradient_clipping=1.0,
                           **({"sequence_parallel_size": sp} if sp > 1 else {}), **keys, **QUIET)
        self.launch_run(name, cfg, procs, ["--steps", STEPS, "--save-every", 3, "--no-export", "--tiled-mlp", mode], args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("tiled_mlp"))


LIGHT = ["pp1", "pp2"]
HEAVY = [pytest.param(name, marks=pytest.mark.heavy)
         for name in ("zero2_dp2", "zero3_dp2", "ckpt_pp1", "ckpt_pp2", "chat_pp1", "sp2", "pp2sp2")]


@pytest.mark.parametrize("layout", LIGHT + HEAVY)
def test_the_tiled_mlp_trains_as_the_whole_mlp_does(runs, layout):
    assert_same(runs / f"{layout}_on", runs / f"{layout}_off")
    shards = LAYOUTS[layout][-1]
    on, off = ((runs.tmp / f"{layout}_{mode}.log").read_text() for mode in ("on", "off"))
    assert f"mlp: tiled in {shards} shards per micro-batch (--tiled-mlp on;" in on, on[-3000:]
    assert "mlp: whole (--tiled-mlp off;" in off, off[-3000:]


def test_a_resumed_tiled_pipeline_continues_the_losses(runs):
    want, got = losses(runs / "pp2_on"), losses(runs / "pp2_on_resumed")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in range(4, STEPS + 1)), (got, want)
