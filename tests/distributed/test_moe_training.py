"""MoE checkpoints saved by transformers, trained by `dstk train` on forked ranks (tests/ranks.py, gloo): with the
router aux loss on (output_router_logits, coef 0.5), pp 1 (the HF model's own loss), pp 2 under 1F1B and pp 2 under
DualPipeV give the same losses, for mixtral and qwen3_moe; with --lora the fused experts train alike at pp 1 and
pp 2, and the pp 2 run's export is what PEFT makes of its adapters. The data are short documents, so rows are
packed and padded: the aux loss counts padding at pp 1 in a packed micro-batch (HF gets no mask), and so must
the stages (models/moe.py). In-process checks of every type: tests/unit/test_moe_aux.py, test_lora_experts.py."""

import json
import re
from pathlib import Path

import pytest

from tests.configs import run_config
from tests.unit.test_moe_aux import AUX, SIX

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
STEPS, SEQ = 3, 64


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder with docs.txt (the corpus's sentences, one document each: 40-100 tokens, packed 1-3 to a row of 64
    with padding) and a saved mixtral and qwen3_moe (vocab 320: the byte tokenizer's ids) with the aux loss on."""
    from toolkit.train.hf import byte_tokenizer
    from toolkit.train.parity import small_model

    tmp = tmp_path_factory.mktemp("moe")
    text = (REPO / "toolkit" / "corpus" / "corpus.txt").read_text()
    sentences = [s.strip() for s in re.split(r"(?<=\.)\s+", text) if s.strip()]
    (tmp / "docs.txt").write_text("\n\n".join(sentences[:400]) + "\n")
    for model_type in ("mixtral", "qwen3_moe"):
        small_model(model_type, attn_implementation="eager", vocab_size=320, **AUX, **SIX[model_type]).save_pretrained(
            tmp / model_type)
        byte_tokenizer().save_pretrained(tmp / model_type)
    return tmp


def train(inputs: Path, model: str, name: str, procs: int, pp: int, *flags) -> Path:
    """`dstk train` of inputs/model on `procs` ranks at `pp` stages, micro-batch 2 x gas 4 -> its --out."""
    from tests.ranks import run_train

    cfg = inputs / f"{name}.json"
    cfg.write_text(json.dumps(run_config(2, 4, pp, clip=1.0)))
    out = inputs / name
    rc, log = run_train(["--config", cfg, "--model", inputs / model, "--data", inputs / "docs.txt", "--seq-len", SEQ,
                         "--steps", STEPS, "--eval-fraction", "0.01", "--no-progress", "--attention", "eager",
                         "--out", out, *flags], procs)
    assert rc == 0, log[-3000:]
    (out / "run.log").write_text(log)
    return out


def losses(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r and "loss" in r}


def far(got: dict, ref: dict, rel: float = 1e-5) -> dict:
    return {s: (got.get(s), ref[s]) for s in ref if got.get(s) is None or abs(got[s] - ref[s]) > rel * abs(ref[s])}


@pytest.mark.parametrize("model_type", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.heavy)])
def test_the_aux_loss_trains_pp1s_losses_at_pp2_under_1f1b_and_dualpipev(inputs, model_type):
    ref = losses(train(inputs, model_type, f"{model_type}_pp1", 1, 1, "--no-export"))
    assert sorted(ref) == list(range(1, STEPS + 1))
    for name, flags in (("1f1b", ()), ("dualpipev", ("--schedule", "dualpipev"))):
        got = losses(train(inputs, model_type, f"{model_type}_{name}", 2, 2, "--no-export", *flags))
        assert not far(got, ref), (name, far(got, ref))


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def test_lora_trains_the_experts_alike_at_pp1_and_pp2_and_exports_what_peft_merges(inputs):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = ("--lora", "--lora-r", "4")
    ref = losses(train(inputs, "mixtral", "lora_pp1", 1, 1, "--no-export", *lora))
    out = train(inputs, "mixtral", "lora_pp2", 2, 2, *lora)
    assert not far(losses(out), ref), far(losses(out), ref)
    assert "mlp.experts.down_proj, mlp.experts.gate_up_proj" in (out / "run.log").read_text()  # the opening block
    base = inputs / "mixtral"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out / "adapter")
    with torch.no_grad():
        want = {k: v.clone() for k, v in peft.eval().merge_and_unload().state_dict().items()}
    got = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # the streamed merge is peft's, to the bit
    on_disk, stored = _weights(out / "hf"), _weights(base)
    assert sorted(on_disk) == sorted(stored)  # the checkpoint's per-expert names (block_sparse_moe.experts.E.w1)
    assert all(not torch.equal(on_disk[k], stored[k]) for k in stored if ".experts." in k)  # every expert trained


@pytest.mark.heavy
def test_lora_on_the_experts_trains_1f1bs_losses_under_dualpipev(inputs):
    """4 blocks: DualPipeV cuts 7 layers into 4 stages, and rank 0 (the first and the last stage) holds a block."""
    from toolkit.train.hf import byte_tokenizer
    from toolkit.train.parity import small_model

    small_model("mixtral", attn_implementation="eager", vocab_size=320, num_hidden_layers=4, **AUX,
                **SIX["mixtral"]).save_pretrained(inputs / "mixtral4")
    byte_tokenizer().save_pretrained(inputs / "mixtral4")
    lora = ("--lora", "--lora-r", "4", "--no-export")
    ref = losses(train(inputs, "mixtral4", "lora_1f1b", 2, 2, *lora))
    got = losses(train(inputs, "mixtral4", "lora_dpv", 2, 2, *lora, "--schedule", "dualpipev"))
    assert not far(got, ref), far(got, ref)
