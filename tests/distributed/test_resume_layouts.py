"""`--resume` on another layout continues the run (issue 14): 10 steps on layout A, then `--resume` on
layout B to step 20, gives the losses of 20 uninterrupted steps on A (1e-4 relative) and the same final
weights (1e-5): Adam's moments, the optimizer step, the LR schedule (warmup + decay) and the data
position all carry over by HF name (toolkit/checkpoint/portable.py). fp32, dropout off, clipping off.

One reference run (pp2/dp1, ZeRO-0, 20 steps, a checkpoint every 5) is the source of most moves; the
moves chain so that each launch tests one: pp2/dp1 ZeRO-0 -> pp1/dp2 ZeRO-3 (written into ZeRO-3's
partitions) -> pp1/dp2 ZeRO-1 (read from ZeRO-3's) -> pp2/dp1 ZeRO-0 (read from ZeRO-1's), pp2 -> pp4,
pp2 -> pp2/dp2 -> pp1/dp1 ZeRO-2. A LoRA run (adapters on a base read from a HF directory) moves too:
pp2/dp1 ZeRO-0 -> pp1/dp2 ZeRO-3, its adapters' state by peft's names, the base re-read from --model.
"""

import json
import shutil
from pathlib import Path

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import COMMON, launch
from tests.distributed.test_train import losses
from toolkit.checkpoint import manifest

pytestmark = pytest.mark.distributed

SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                                "total_num_steps": 20}}


def config(path: Path, pp: int, dp: int, zero: int = 0) -> Path:
    """gbs 8 on every layout: mbs 2 x gas (4 / dp) x dp."""
    return write_config(path, mbs=2, gas=4 // dp, optimizer=OPTIMIZER, zero=zero, pp=pp, gradient_clipping=0.0,
                        scheduler=SCHEDULER, **QUIET)


def resumed_from(source: Path, step: int, out: Path) -> Path:
    """A copy of run `source` whose latest checkpoint is global_step<step> (the later ones removed)."""
    shutil.copytree(source, out)
    ckpt = out / "checkpoints"
    for later in ckpt.glob("global_step*"):
        if int(later.name.removeprefix("global_step")) > step:
            shutil.rmtree(later)
    manifest.write_latest(ckpt, f"global_step{step}")
    lines = [line for line in (out / "metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line) and json.loads(line)["step"] <= step]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return out


def run(tmp: Path, name: str, pp: int, dp: int, zero: int, steps: int, resume_from=None, every: int = 5,
        model_args=COMMON):
    out = tmp / name
    if resume_from is not None:
        resumed_from(*resume_from, out)
    args = ["--steps", steps, "--save-every", every, "--no-export", "--eval-fraction", 0]
    rc, log = launch(config(tmp / f"{name}.json", pp, dp, zero), out, pp * dp, *args,
                     *(["--resume"] if resume_from is not None else []), model_args=model_args)
    assert rc == 0, log[-3000:]
    # a pipeline's load broadcasts its tied weights in place: under autograd torch warned at the next backward
    assert "c10d::broadcast_" not in log, log[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("moves")
    out = {"A": run(tmp, "A", 2, 1, 0, 20)}
    out["pp1dp2z3"] = run(tmp, "pp1dp2z3", 1, 2, 3, 20, resume_from=(out["A"], 10))
    out["pp1dp2z1"] = run(tmp, "pp1dp2z1", 1, 2, 1, 20, resume_from=(out["pp1dp2z3"], 15), every=1)
    out["pp2dp1z0"] = run(tmp, "pp2dp1z0", 2, 1, 0, 20, resume_from=(out["pp1dp2z1"], 17))
    out["pp4"] = run(tmp, "pp4", 4, 1, 0, 20, resume_from=(out["A"], 10))
    out["pp2dp2"] = run(tmp, "pp2dp2", 2, 2, 0, 15, resume_from=(out["A"], 10))
    out["pp1dp1z2"] = run(tmp, "pp1dp1z2", 1, 1, 2, 20, resume_from=(out["pp2dp2"], 15))
    lora = lora_args(saved_models.get("tiny-gpt2"))
    out["lora"] = run(tmp, "lora", 2, 1, 0, 20, model_args=lora)
    out["lora_pp1dp2z3"] = run(tmp, "lora_pp1dp2z3", 1, 2, 3, 20, resume_from=(out["lora"], 10), model_args=lora)
    return out


def lora_args(base: Path) -> list:
    """A LoRA run on tiny GPT-2 saved as a HF directory (`base`, seed 1234: what a user fine-tunes)."""
    return [str(base) if a == "tiny-gpt2" else a for a in COMMON] + ["--lora", "--lora-r", "4"]


def final_weights(out: Path) -> dict:
    from toolkit.checkpoint.state import load_state_dict

    return load_state_dict(out / "checkpoints", "global_step20")[0]


@pytest.mark.parametrize("name, first", [("pp1dp2z3", 11), ("pp1dp2z1", 16), ("pp2dp1z0", 18), ("pp4", 11),
                                         ("pp2dp2", 11), ("pp1dp1z2", 16), ("lora_pp1dp2z3", 11)])
def test_a_run_moved_to_another_layout_continues_as_if_uninterrupted(runs, name, first):
    source = runs["lora" if name.startswith("lora") else "A"]
    reference, moved = losses(source), losses(runs[name])
    last = max(moved)
    assert sorted(moved) == list(range(1, last + 1))  # the steps before the move kept, each step once
    for step in range(first, last + 1):
        assert abs(moved[step] - reference[step]) <= 1e-4 * abs(reference[step]), (name, step, moved, reference)
    if last == 20:
        want, got = final_weights(source), final_weights(runs[name])
        assert set(got) ^ set(want) <= {"lm_head.weight"}  # pp = 1 also names the tied head
        assert not name.startswith("lora") or sum("lora_" in k for k in want) == 32  # 4 blocks x 4 modules x A, B
        assert max((got[k] - want[k]).abs().max().item() for k in set(want) & set(got)) <= 1e-5


def test_a_moved_checkpoint_keeps_each_tags_own_layout(runs):
    """Tags written before the move keep the layout they were written with: export and a later resume
    read a tag with its own layer map."""
    from toolkit.checkpoint.state import load_state_dict

    ckpt = runs["pp1dp2z1"] / "checkpoints"
    before, layout_before = load_state_dict(ckpt, "global_step10")  # written by A at pp 2
    after, layout_after = load_state_dict(ckpt, "global_step15")  # written after the move, pp 1 ZeRO-3
    assert (layout_before["pp"], layout_after["pp"], layout_after["zero_stage"]) == (2, 1, 3)
    assert set(before) ^ set(after) <= {"lm_head.weight"}  # pp = 1 also names the tied head
    # the move staged the source tag's state by HF name (rank 0, once) and removed it when every rank had read it
    assert sorted(p.name for p in (runs["pp1dp2z3"] / "checkpoints" / "global_step10").iterdir()) == sorted(
        p.name for p in (runs["A"] / "checkpoints" / "global_step10").iterdir())
