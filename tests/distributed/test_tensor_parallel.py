"""`dstk train` with tensor parallelism (DeepSpeed AutoTP, pp = 1) through the real launcher: CPU
processes on gloo, the built-in tiny Llama (4 heads, 2 key/value heads: tp 2 divides both).

tp 2 (ZeRO-1) and dp 2 x tp 2 (4 processes, ZeRO-2) give the 10 losses of tp 1 (1e-4, fp32, gbs 8
everywhere: every rank of a tp group is fed the same micro-batches); the export merges the shards
through the map AutoTP saves with them: full HF shapes, from_pretrained loads it, and its loss over the
eval split equals the eval loss the sharded engine reported (so the merged weights are the trained
ones), and its weights equal tp 1's. Under bf16 the export holds the fp32 masters (not the bf16 weights
the shards hold) and gives the bf16 engine's eval loss to bf16's precision. A tp 2 run resumed from its step-5 checkpoint (DeepSpeed's own
load of the tp shards) continues with the uninterrupted run's losses.
"""

import json
from pathlib import Path

import pytest

from tests.distributed.test_resume_layouts import resumed_from
from tests.distributed.test_train import CORPUS, OPTIMIZER, launch, losses, summary
from tests.reference import eval_reference

pytestmark = pytest.mark.distributed

ARGS = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0.05"]
LAYOUTS = {"tp1": (1, 1, 0), "tp2": (2, 2, 1), "dp2tp2": (4, 2, 2), "tp2bf16": (2, 2, 0)}  # procs, tp, ZeRO stage


def config(path: Path, procs: int, tp: int, zero: int, bf16: bool = False) -> Path:
    dp = procs // tp
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // dp, "gradient_clipping": 0.0,
           "optimizer": OPTIMIZER, "zero_optimization": {"stage": zero}, "steps_per_print": 10**6,
           "bf16": {"enabled": bf16}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    for name, (procs, tp, zero) in LAYOUTS.items():
        rc, log = launch(config(tmp / f"{name}.json", procs, tp, zero, "bf16" in name), tmp / name, procs, "--steps", 10,
                         "--save-every", 5, model_args=ARGS)
        assert rc == 0, f"{name}:\n{log[-4000:]}"
    resumed_from(tmp / "tp2", 5, tmp / "tp2_resumed")
    rc, log = launch(tmp / "tp2.json", tmp / "tp2_resumed", 2, "--steps", 10, "--resume", "--no-export", model_args=ARGS)
    assert rc == 0, f"tp2_resumed:\n{log[-4000:]}"
    return tmp


@pytest.mark.parametrize("name", ["tp2", "dp2tp2"])
def test_tensor_parallel_layouts_give_the_losses_of_one_process(runs, name):
    want, got = losses(runs / "tp1"), losses(runs / name)
    assert sorted(got) == list(range(1, 11))
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in want), (got, want)
    assert summary(runs / name)["steps"] == 10


@pytest.mark.parametrize("name", ["tp2", "dp2tp2"])
def test_the_export_merges_the_shards_into_the_trained_model(runs, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.train import data

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


def test_a_tensor_parallel_run_resumes_from_its_shards(runs):
    want, got = losses(runs / "tp2"), losses(runs / "tp2_resumed")
    assert sorted(got) == list(range(1, 11)) and summary(runs / "tp2_resumed")["start_step"] == 5
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in range(6, 11)), (got, want)


def test_a_bf16_tensor_parallel_export_holds_the_fp32_masters(runs):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.train import data

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
