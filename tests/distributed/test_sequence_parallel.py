"""`dstk train` with Ulysses sequence parallelism (sp, "sequence_parallel_size"): CPU processes on gloo,
forked from the warm rank server (tests/ranks.py), the built-in tiny Llama (4 heads, 2 key/value heads:
sp 2 splits both). DeepSpeed's UlyssesSPAttentionHF with dstk's document-masking sdpa core
(toolkit.distributed.sequence_parallel): sp 2 on 2 ranks gives one process's losses, grad norms and eval
loss (1e-4, fp32, gbs 8: mbs 2 x gas 4) on packed text, whose documents one process keeps apart (so the
sp run masks them too: plain Ulysses under sdpa would not); the same under ZeRO-3, on chat rows with
LoRA, sp 2 x dp 2 (4 ranks), and inside pipeline stages: pp 2 x sp 2 (4 ranks) on packed text and on chat
rows with LoRA (dstk's own sp-inside-stages, toolkit.distributed.sequence_parallel); a Mistral of tiny-llama's
sizes with an 8-token sliding window (shorter than the rows and most documents: the core's blocks over each
window) at sp 2 against one process. A run resumed from an sp 2 or a pp 2 x sp 2 checkpoint (DeepSpeed's own
load) continues with the uninterrupted run's losses.
"""

import json
from pathlib import Path

import pytest

from tests.configs import OPTIMIZER, QUIET, write_config
from tests.distributed.launch import CORPUS, LazyRuns, launch
from tests.distributed.test_resume_layouts import resumed_from
from tests.distributed.test_train import losses, summary

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TEXT = ["--model", "tiny-llama", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--eval-fraction", "0.05"]
CHAT = ["--model", "tiny-llama", "--data", str(REPO / "toolkit" / "corpus" / "chat.jsonl"), "--chat-template",
        str(REPO / "toolkit" / "corpus" / "chatml.jinja"), "--seq-len", "160", "--no-progress", "--eval-fraction",
        "0.1", "--lora", "--lora-r", "4"]
WINDOWED = ["--model", "WINDOWED_MODEL", *TEXT[2:]]  # the saved Mistral (Runs.windowed_model)
RUNS = {  # procs, sp, ZeRO stage, model arguments[, pipeline stages]
    "sp1": (1, 1, 1, TEXT), "sp2": (2, 2, 1, TEXT), "sp2z3": (2, 2, 3, TEXT), "dp2sp2": (4, 2, 2, TEXT),
    "chat_sp1": (1, 1, 0, CHAT), "chat_sp2": (2, 2, 0, CHAT), "pp2sp2": (4, 2, 1, TEXT, 2),
    "chat_pp2sp2": (4, 2, 0, CHAT, 2), "window_sp1": (1, 1, 1, WINDOWED), "window_sp2": (2, 2, 1, WINDOWED)}
STEPS = 6


class Runs(LazyRuns):
    """Each run's folder, launched the first time a test asks for it; NAME_resumed: NAME resumed from step 3."""

    def _launch(self, name: str) -> None:
        base = name.removesuffix("_resumed")
        procs, sp, zero, args, *pp = RUNS[base]
        pp = pp[0] if pp else None
        args = [str(self.windowed_model()) if a == "WINDOWED_MODEL" else a for a in args]
        cfg = write_config(self.tmp / f"{base}.json", mbs=2, gas=4 * sp * (pp or 1) // procs, optimizer=OPTIMIZER,
                           zero=zero, pp=pp, gradient_clipping=1.0, **({"sequence_parallel_size": sp} if sp > 1 else {}),
                           **QUIET)
        if name == base:
            rc, log = launch(cfg, self.tmp / name, procs, "--steps", STEPS, "--save-every", 3, "--no-export",
                             model_args=args)
        else:
            resumed_from(self / base, 3, self.tmp / name)
            rc, log = launch(cfg, self.tmp / name, procs, "--steps", STEPS, "--resume", "--no-export", model_args=args)
        assert rc == 0, f"{name}:\n{log[-4000:]}"

    def windowed_model(self) -> Path:
        """tiny-llama's sizes as a Mistral with sliding_window 8, random weights, saved with the byte tokenizer."""
        import torch
        from transformers import LlamaConfig, MistralConfig, MistralForCausalLM

        from toolkit.train import hf

        out = self.tmp / "mistral_window8"
        if not out.exists():
            llama = hf.load_config("tiny-llama", hf.byte_tokenizer(), "causal-lm").to_dict()
            fields = {k: llama[k] for k in LlamaConfig().to_dict() if k in MistralConfig().to_dict() and k in llama
                      and k not in ("model_type", "transformers_version", "architectures")}
            torch.manual_seed(0)
            MistralForCausalLM(MistralConfig(**fields, sliding_window=8)).save_pretrained(out)
            hf.byte_tokenizer().save_pretrained(out)
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("sp"))


def records(out: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r}


def heavy(*values):  # a case whose runs are in the heavy tier (ZeRO-3, sliding windows: ~25 s)
    return pytest.param(*values, marks=pytest.mark.heavy)


def same(got: dict, want: dict, rel=1e-4) -> bool:
    return sorted(got) == sorted(want) and all(abs(got[s] - want[s]) <= rel * abs(want[s]) for s in want)


@pytest.mark.parametrize("name, reference", [("sp2", "sp1"), heavy("sp2z3", "sp1"), ("chat_sp2", "chat_sp1"),
                                             ("dp2sp2", "sp1"), ("pp2sp2", "sp1"), ("chat_pp2sp2", "chat_sp1"),
                                             heavy("window_sp2", "window_sp1")])
def test_sp_gives_the_losses_grad_norms_and_eval_loss_of_one_process(runs, name, reference):
    got, want = records(runs / name), records(runs / reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert same({s: r["loss"] for s, r in got.items()}, {s: r["loss"] for s, r in want.items()}), (got, want)
    # the gradient counted once per token: DeepSpeed sums over all ranks and divides by dp = world / sp
    assert same({s: r["grad_norm"] for s, r in got.items()}, {s: r["grad_norm"] for s, r in want.items()})
    assert abs(summary(runs / name)["eval_loss"] - summary(runs / reference)["eval_loss"]) <= 1e-4 * 5


@pytest.mark.parametrize("name, dp, pp", [("dp2sp2", 2, 1), ("pp2sp2", 1, 2)])
def test_the_run_says_its_layout(runs, name, dp, pp):
    layout = summary(runs / name)["run"]["layout"]
    assert (layout["dp"], layout["sp"], layout["pp"]) == (dp, 2, pp)


@pytest.mark.parametrize("name", ["sp2", "pp2sp2"])
def test_a_resumed_sp_run_continues_the_losses(runs, name):
    want, got = losses(runs / name), losses(runs / f"{name}_resumed")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert same({s: got[s] for s in range(4, STEPS + 1)}, {s: want[s] for s in range(4, STEPS + 1)}), (got, want)

