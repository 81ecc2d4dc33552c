"""--objective dpo through pipelines (issue 47), on real gloo ranks: a tiny GPT-2 saved as a HF directory, the shipped
preference pairs, gbs 8 rows (4 pairs) on every layout, fp32, clipping at 1.0.

- pp 2 (1F1B; the default tier), pp 2 x dp 2 (ZeRO-1), pp 2 under DualPipeV and pp 1 x dp 2 under ZeRO-3 give
  pp 1's losses and TRL's metrics to 1e-4 over 4 steps, full fine-tuning and LoRA (at pp 1 LoRA's reference is the
  base under PEFT's disable_adapter, live; in a pipeline the initial model's log-probs, precomputed: B is zero at
  init), each layout computing its own reference (its own --data-cache)
- step 1's loss is ln 2; the eval loss is the DPO loss of the held-out pairs, the same on every layout
- a resume continues the losses, reading the cached reference (never computing it again); a pp 2 checkpoint resumed
  at pp 1 continues them too
- the export loads with from_pretrained; LoRA's adapters load with PEFT onto the base
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.configs import adamw, ds_config, write_config, FULL_ADAMW
from tests.distributed.launch import LazyRuns, launch
from tests.distributed.test_resume_layouts import resumed_from
from tests.unit.test_dpo_data import PAIRS

pytestmark = pytest.mark.distributed

SEED, STEPS = 1234, 4
# (pp, dp, mbs rows, gas, ZeRO stage): gbs 8 rows; dualpipev: --schedule dualpipev (gas >= 2 pp)
LAYOUTS = {"pp1": (1, 1, 4, 2, 0), "pp2": (2, 1, 4, 2, 0), "pp2dp2": (2, 2, 4, 1, 1), "dualpipev": (2, 1, 2, 4, 0),
           "pp1dp2z3": (1, 2, 4, 1, 3)}
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "logps/rejected")


def records(out: Path) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "step" in r}


def summary(out: Path) -> dict:
    return [json.loads(line)["summary"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "summary" in json.loads(line)][-1]


class DpoRuns(LazyRuns):
    """NAME = [lora_]LAYOUT, or full_pp2_resumed (full_pp2 from its step 2), full_moved (full_pp2's step 2 at pp 1)."""

    def __init__(self, tmp: Path, base: Path):
        super().__init__(tmp)
        self.base = base

    def _launch(self, name: str) -> None:
        kind, layout = name.split("_")[:2]
        pp, dp, mbs, gas, zero = LAYOUTS["pp1" if name == "full_moved" else layout]
        cfg = ds_config(mbs, gas, optimizer=adamw(1e-3, **FULL_ADAMW), gradient_clipping=1.0, pp=pp, zero=zero,
                        steps_per_print=10**6)
        flags = ["--steps", STEPS, "--save-every", 2, "--data-cache", self.tmp / f"cache_{name}"]
        if layout == "dualpipev":
            flags += ["--schedule", "dualpipev"]
        if name.endswith(("_resumed", "_moved")):
            resumed_from(self / "full_pp2", 2, self.tmp / name)
            shutil.copytree(self.tmp / "cache_full_pp2", self.tmp / f"cache_{name}")  # its reference, cached
            flags.append("--resume")
        if kind == "lora":
            flags += ["--lora", "--lora-r", "4"]
        args = ["--model", str(self.base), "--data", str(PAIRS), "--seq-len", "128", "--no-progress",
                "--objective", "dpo", "--eval-fraction", "0.05"]
        rc, log = launch(write_config(self.tmp / f"{name}.json", cfg), self.tmp / name, pp * dp, *flags,
                         model_args=args, timeout=600)
        assert rc == 0, f"{name}:\n{log[-4000:]}"
        (self.tmp / f"{name}.log").write_text(log)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved_models):
    return DpoRuns(tmp_path_factory.mktemp("dpo"), saved_models.get("tiny-gpt2", SEED))


def log(runs, name: str) -> str:
    runs / name  # launched first, if no test has asked for it yet
    return (runs.tmp / f"{name}.log").read_text()


def close(a: dict, b: dict, steps) -> list:
    """The (step, key) where the records differ by more than 1e-4 (relative, or 1e-6 absolute near 0)."""
    return [(s, k, a[s][k], b[s][k]) for s in steps for k in KEYS
            if abs(a[s][k] - b[s][k]) > max(1e-4 * abs(b[s][k]), 1e-6)]


HEAVY = pytest.mark.heavy


@pytest.mark.parametrize("kind, layout", [("full", "pp2"), *(pytest.param(k, lay, marks=HEAVY) for k, lay in (
    ("lora", "pp2"), ("full", "pp2dp2"), ("lora", "pp2dp2"), ("full", "dualpipev"), ("lora", "dualpipev"),
    ("full", "pp1dp2z3"), ("lora", "pp1dp2z3")))])
def test_other_layouts_give_pp1s_losses_and_rewards(runs, kind, layout):
    ref, got = records(runs / f"{kind}_pp1"), records(runs / f"{kind}_{layout}")
    assert abs(ref[1]["loss"] - math.log(2)) < 1e-5 and abs(got[1]["loss"] - math.log(2)) < 1e-5
    assert ref[STEPS]["rewards/margins"] != 0 and ref[STEPS]["loss"] != ref[1]["loss"]  # the policy moved
    assert close(got, ref, range(1, STEPS + 1)) == []
    ours, theirs = summary(runs / f"{kind}_{layout}")["eval_loss"], summary(runs / f"{kind}_pp1")["eval_loss"]
    assert ours == pytest.approx(theirs, rel=1e-4) and ours != pytest.approx(math.log(2), abs=1e-4)


@HEAVY
def test_the_reference_is_computed_once_and_read_on_resume(runs):
    first, again = log(runs, "full_pp2"), log(runs, "full_pp2_resumed")
    assert "reference: the initial weights' log-probs, computed before step 1" in first
    assert "log-probs, read from dpo-reference-" in again and "computed before" not in again
    assert "reference: the base with the adapters off" in log(runs, "lora_pp1")


@HEAVY
@pytest.mark.parametrize("name", ["full_pp2_resumed", "full_moved"])
def test_a_resume_continues_the_losses_on_the_same_layout_and_moved_to_pp1(runs, name):
    ref, got = records(runs / "full_pp2"), records(runs / name)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert close(got, ref, range(3, STEPS + 1)) == []


@HEAVY
def test_the_exports_load_with_transformers_and_peft(runs):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[72, 105, 33, 32, 65]])
    full = AutoModelForCausalLM.from_pretrained(runs / "full_pp2" / "hf")
    base = AutoModelForCausalLM.from_pretrained(runs.base)
    assert not torch.equal(full(ids).logits, base(ids).logits)  # trained
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs.base), runs / "lora_pp2" / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(runs / "lora_pp2" / "hf")
    assert torch.allclose(adapted(ids).logits, merged(ids).logits, atol=1e-5)
    assert not torch.allclose(adapted(ids).logits, base(ids).logits, atol=1e-6)
