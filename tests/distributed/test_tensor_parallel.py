"""`dstk train` with tensor parallelism: CPU processes on gloo, the built-in tiny
Llama (4 heads, 2 key/value heads: tp 2 divides both). At pp = 1 DeepSpeed's AutoTP shards the model; with
pipeline stages dstk shards each stage's blocks over the stage's tp group (toolkit.distributed.tensor_parallel: 3D).

tp 2 (ZeRO-1), dp 2 x tp 2 (4 processes, ZeRO-2) and pp 2 x tp 2 (ZeRO-0) give the 10 losses of one process
(1e-4, fp32, gbs 8 everywhere: every rank of a tp group is fed the same micro-batches; gradient clipping at
1.0, which these runs trigger, so every layout must count each gradient once in the norm); the export merges
the shards through the map AutoTP makes of them: full HF shapes, from_pretrained loads it, and its loss over
the eval split equals the eval loss the sharded engine reported (so the merged weights are the trained
ones), and its weights equal tp 1's. Under bf16 the export holds the fp32 masters (not the bf16 weights the
shards hold) and gives the bf16 engine's eval loss to bf16's precision: at pp = 1 ZeRO-0, and in 3D
(dp 2 x pp 2 x tp 2, 8 processes, ZeRO-1). A tp 2 and a pp 2 x tp 2 run resumed from their step-5
checkpoints (DeepSpeed's own load of the tp shards) continue with the uninterrupted runs' losses.
Ranks are forked from the warm rank server (tests/ranks.py); the 8-process 3D case is in the heavy tier.
"""

import json
from pathlib import Path

import pytest

from tests.distributed.test_resume_layouts import resumed_from
from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, launch
from tests.distributed.test_train import losses, summary
from tests.reference import eval_reference

pytestmark = pytest.mark.distributed

ARGS = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0.05"]
LAYOUTS = {  # procs, pp, tp, ZeRO stage
    "tp1": (1, 1, 1, 0), "tp2": (2, 1, 2, 1), "dp2tp2": (4, 1, 2, 2), "tp2bf16": (2, 1, 2, 0),
    "pp2tp2": (4, 2, 2, 0), "dp2pp2tp2bf16": (8, 2, 2, 1), "dp2tp2z3": (4, 1, 2, 3)}
FROM_DIR = ("dp2tp2z3",)  # ZeRO-3 builds a built-in model under zero.Init (another init): the same weights saved
Z3_HEAVY = pytest.param("dp2tp2z3", marks=pytest.mark.heavy)  # ZeRO-3 x tp: ~30 s of runs, in the heavy tier


def config(path: Path, procs: int, pp: int, tp: int, zero: int, bf16: bool = False) -> Path:
    dp = procs // (pp * tp)
    return write_config(path, mbs=2, gas=4 // dp, optimizer=OPTIMIZER, zero=zero, pp=pp, tp=tp, bf16=bf16,
                        gradient_clipping=1.0, **QUIET)


class Runs:
    """The folder of each layout's run, launched the first time a test asks for it (`runs / "tp2"`), so a
    selection of tests (the default tier leaves out the heavy 3D case) launches only what it reads. A
    name ending in _resumed is that layout's run resumed from its step-5 checkpoint."""

    def __init__(self, tmp: Path, llama_dir: Path):
        self.tmp, self.llama_dir, self.done = tmp, llama_dir, set()

    def __truediv__(self, name: str) -> Path:
        if name not in self.done:
            self.done.add(self._launch(name))
        return self.tmp / name

    def _launch(self, name: str) -> str:
        layout = name.removesuffix("_resumed")
        procs, pp, tp, zero = LAYOUTS[layout]
        if name == layout:
            cfg = config(self.tmp / f"{name}.json", procs, pp, tp, zero, "bf16" in name)
            rc, log = launch(cfg, self.tmp / name, procs, "--steps", 10, "--save-every", 5,
                             model_args=_args(self.llama_dir, name))
        else:
            resumed_from(self / layout, 5, self.tmp / name)
            rc, log = launch(self.tmp / f"{layout}.json", self.tmp / name, procs, "--steps", 10, "--resume",
                             "--no-export", model_args=_args(self.llama_dir, layout))
        assert rc == 0, f"{name}:\n{log[-4000:]}"
        return name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved_models):
    """The built-in tiny-llama as dstk train builds it (seed 1234), saved: what the FROM_DIR layouts load."""
    return Runs(tmp_path_factory.mktemp("tp"), saved_models.get("tiny-llama"))


def _args(llama_dir: Path, name: str) -> list:
    return ["--model", str(llama_dir), *ARGS[2:]] if name in FROM_DIR else ARGS


@pytest.mark.parametrize("name", ["tp2", "dp2tp2", "pp2tp2", Z3_HEAVY])
def test_tensor_parallel_layouts_give_the_losses_of_one_process(runs, name):
    want, got = losses(runs / "tp1"), losses(runs / name)
    assert sorted(got) == list(range(1, 11))
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in want), (got, want)
    assert summary(runs / name)["steps"] == 10


@pytest.mark.parametrize("name", ["tp2", "dp2tp2", "pp2tp2", Z3_HEAVY])
def test_the_export_merges_the_shards_into_the_trained_model(runs, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit import data

    model = AutoModelForCausalLM.from_pretrained(runs / name / "hf").eval()
    full = AutoModelForCausalLM.from_pretrained(runs / "tp1" / "hf")
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in full.state_dict().items()}
    held = data.prepare(data.DataOptions(str(CORPUS), 32, eval_fraction=0.05),
                        AutoTokenizer.from_pretrained(runs / name / "hf")).eval
    reported = summary(runs / name)["eval_loss"]
    assert abs(eval_reference(model, held) - reported) <= 1e-5 * reported
    mine = {k: v for f in (runs / name / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    ref = {k: v for f in (runs / "tp1" / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(mine) == set(ref)
    assert max((mine[k] - ref[k]).abs().max().item() for k in ref) <= 1e-4


@pytest.mark.parametrize("name", [Z3_HEAVY, "pp2tp2"])
def test_a_tensor_parallel_run_resumes_from_its_shards(runs, name):
    want, got = losses(runs / name), losses(runs / f"{name}_resumed")
    assert sorted(got) == list(range(1, 11)) and summary(runs / f"{name}_resumed")["start_step"] == 5
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in range(6, 11)), (got, want)


def test_pipeline_stages_hold_tp_shards_of_their_blocks_only(runs):
    """pp 2 x tp 2: a block's projections are halved on each tp rank (q by rows, down by columns; tiny-llama:
    hidden 64, MLP 176), the embedding is whole (the tokenizer's vocabulary x 64) and the same on both."""
    import torch

    tag = runs / "pp2tp2" / "checkpoints" / "global_step10"
    block = [torch.load(tag / f"layer_01-model_{t:02d}-model_states.pt", weights_only=True) for t in (0, 1)]
    embed = [torch.load(tag / f"layer_00-model_{t:02d}-model_states.pt", weights_only=True) for t in (0, 1)]
    q, down = (next(n for n in block[0] if n.endswith(end)) for end in ("q_proj.weight", "down_proj.weight"))
    assert [tuple(b[q].shape) for b in block] == [(32, 64)] * 2 and not torch.equal(block[0][q], block[1][q])
    assert [tuple(b[down].shape) for b in block] == [(64, 88)] * 2
    vocab = json.loads((runs / "pp2tp2" / "hf" / "config.json").read_text())["vocab_size"]
    assert embed[0] and all(torch.equal(t, embed[1][n]) and t.shape == (vocab, 64) for n, t in embed[0].items())


@pytest.mark.heavy
def test_a_3d_bf16_export_holds_the_fp32_masters(runs):
    """dp 2 x pp 2 x tp 2, ZeRO-1, bf16: the losses follow one fp32 process to bf16's precision; the export
    holds the fp32 masters, whose tp-rank-1 rows round to that rank's bf16 shard."""
    import torch
    from safetensors.torch import load_file

    want, got = losses(runs / "tp1"), losses(runs / "dp2pp2tp2bf16")
    assert sorted(got) == list(range(1, 11)) and all(abs(got[s] - want[s]) <= 2e-2 * want[s] for s in want)
    exported = load_file(runs / "dp2pp2tp2bf16" / "hf" / "model.safetensors")
    tag = runs / "dp2pp2tp2bf16" / "checkpoints" / "global_step10"
    shard = torch.load(tag / "layer_04-model_01-model_states.pt", weights_only=True)  # block 3, stage 1
    key = next(n for n in shard if n.endswith("up_proj.weight"))
    rows = exported["model.layers.3.mlp.up_proj.weight"][shard[key].shape[0]:]  # column-parallel: rank 1's rows
    assert exported["model.layers.3.mlp.up_proj.weight"].dtype == torch.float32 and shard[key].dtype == torch.bfloat16
    assert torch.equal(rows.bfloat16(), shard[key]) and not torch.equal(rows, rows.bfloat16().float())


def test_a_bf16_tensor_parallel_export_holds_the_fp32_masters(runs):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit import data

    exported = load_file(runs / "tp2bf16" / "hf" / "model.safetensors")
    shard = torch.load(runs / "tp2bf16" / "checkpoints" / "global_step10" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    name = "model.layers.0.self_attn.q_proj.weight"  # column-parallel: rank 0 holds the first rows
    mine = exported[name][: shard[name].shape[0]]
    assert exported[name].dtype == torch.float32 and shard[name].dtype == torch.bfloat16
    assert torch.equal(mine.bfloat16(), shard[name]) and not torch.equal(mine, mine.bfloat16().float())
    model = AutoModelForCausalLM.from_pretrained(runs / "tp2bf16" / "hf").eval()
    held = data.prepare(data.DataOptions(str(CORPUS), 32, eval_fraction=0.05),
                        AutoTokenizer.from_pretrained(runs / "tp2bf16" / "hf")).eval
    reported = summary(runs / "tp2bf16")["eval_loss"]
    assert abs(eval_reference(model, held) - reported) <= 1e-2 * reported
