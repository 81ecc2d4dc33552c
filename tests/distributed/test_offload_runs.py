"""`dstk train --offload-activations on` against the same run with its checkpoints on the device (off), activation
checkpointing on in both: the same losses, gradient norms and eval loss (1e-5, fp32) on CPU ranks forked from the
warm rank server, the built-in tiny Llama. On a CPU the checkpoints are copied within host memory, through the same
DeepSpeed offload engines a GPU uses (models.tiled.offload): HF's non-reentrant checkpointing at pp 1, the
pipeline's deepspeed.checkpointing in stages. Packed text at pp 1 and pp 2 (1F1B), and a pp 2 run resumed from step
3; heavy: chat rows with assistant-only labels and LoRA, sp 2, pp 2 x sp 2 (4 ranks), dp 2 under ZeRO-3, and every
long-sequence feature at once (tiled loss, tiled MLP, offload) against none of them at pp 2 x sp 2, on packed text
and on chat rows with assistant-only labels and LoRA."""

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, LazyRuns
from tests.distributed.test_tiled_loss_runs import STEPS, assert_same
from tests.distributed.test_tiled_mlp_runs import CHAT, ZERO3
from tests.distributed.test_train import losses

pytestmark = pytest.mark.distributed

TEXT = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "64", "--no-progress", "--eval-fraction", "0.05"]
LAYOUTS = {  # processes, pp, sp, model arguments, ZeRO section
    "pp1": (1, 1, 1, TEXT, {"stage": 1}), "pp2": (2, 2, 1, TEXT, {"stage": 1}),
    "chat_pp1": (1, 1, 1, CHAT, {"stage": 1}), "sp2": (2, 1, 2, TEXT, {"stage": 1}),
    "pp2sp2": (4, 2, 2, TEXT, {"stage": 1}), "zero3_dp2": (2, 1, 1, TEXT, ZERO3), "all_pp2sp2": (4, 2, 2, TEXT, {"stage": 1}),
    "all_chat_pp2sp2": (4, 2, 2, CHAT, {"stage": 1})}
FEATURES = ("--tiled-loss", "--tiled-mlp", "--offload-activations")


class Runs(LazyRuns):
    """NAME_on / NAME_off: layout NAME, activation checkpointing on, with --offload-activations on / off (all_*: every
    feature of FEATURES on / off), launched when a test first asks; NAME_on_resumed: NAME_on resumed from step 3."""

    def _launch(self, name: str) -> None:
        layout, mode = name.removesuffix("_resumed").rsplit("_", 1)
        procs, pp, sp, args, zero = LAYOUTS[layout]
        dp = procs // (pp * sp)
        checkpointing = ({"pipeline": {"stages": pp, "activation_checkpoint_interval": 1}} if pp > 1
                         else {"activation_checkpointing": {}})
        cfg = write_config(self.tmp / f"{layout}.json", mbs=2, gas=4 // dp, optimizer=OPTIMIZER, gradient_clipping=1.0,
                           zero_optimization=zero, **({"sequence_parallel_size": sp} if sp > 1 else {}),
                           **checkpointing, **QUIET)
        features = FEATURES if layout.startswith("all_") else FEATURES[2:]
        flags = [word for feature in features for word in (feature, mode)]
        self.launch_run(name, cfg, procs, ["--steps", STEPS, "--save-every", 3, "--no-export", *flags], args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("offload"))


LIGHT = ["pp1", "pp2"]
HEAVY = [pytest.param(name, marks=pytest.mark.heavy) for name in ("chat_pp1", "sp2", "pp2sp2", "zero3_dp2", "all_pp2sp2",
                                                                    "all_chat_pp2sp2")]


@pytest.mark.parametrize("layout", LIGHT + HEAVY)
def test_offloaded_checkpoints_train_as_those_kept_on_the_device(runs, layout):
    assert_same(runs / f"{layout}_on", runs / f"{layout}_off")
    on, off = ((runs.tmp / f"{layout}_{mode}.log").read_text() for mode in ("on", "off"))
    assert "checkpoints: offloaded to host memory (--offload-activations on;" in on, on[-3000:]
    assert "copied within host memory on a CPU: nothing saved)" in on, on[-3000:]
    assert "checkpoints: kept on the device (--offload-activations off;" in off, off[-3000:]
    if layout.startswith("all_"):
        assert "loss: tiled" in on and "mlp: tiled" in on and "loss: whole" in off and "mlp: whole" in off, on[-3000:]


def test_a_resumed_offloading_pipeline_continues_the_losses(runs):
    want, got = losses(runs / "pp2_on"), losses(runs / "pp2_on_resumed")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in range(4, STEPS + 1)), (got, want)
