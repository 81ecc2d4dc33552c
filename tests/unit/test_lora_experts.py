"""--lora on an MoE model adapts its fused experts (transformers 5's 3-D `mlp.experts.gate_up_proj` / `down_proj`)
through peft's target_parameters, beside the block linears: what each flag resolves to, a pipeline stage injecting
what get_peft_model injects (peft's own v4-name conversion included), and a real pp 1 run from a saved checkpoint
whose adapter folder PEFT loads onto from_pretrained's model and whose merged export is PEFT's merge_and_unload,
written under the checkpoint's per-expert names. pp 2 and DualPipeV: tests/distributed/test_moe_training.py."""

import json
from pathlib import Path

import pytest
import torch

from tests.configs import write_config
from tests.unit.test_moe_aux import SIX
from toolkit.errors import ConfigError
from models.lora import adapters, experts
from toolkit.train import hf
from toolkit.train.parity import small_model

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _mixtral():
    return small_model("mixtral", **SIX["mixtral"])


def test_the_default_targets_of_an_moe_model_are_its_linears_and_its_fused_experts():
    assert adapters.resolve_targets(_mixtral(), adapters.LoraSettings()) == (ATTENTION, EXPERTS)


@pytest.mark.parametrize("targets, dropout, want, frozen", [
    (("gate_up_proj",), 0.0, ([], EXPERTS[:1]), "add down_proj to adapt them"),
    (("q_proj", "mlp.experts.down_proj"), 0.0, (["q_proj"], EXPERTS[1:]), "add gate_up_proj to adapt them"),
    ((), 0.05, (ATTENTION, []), "takes no dropout; --lora-dropout 0 adapts them"),
])
def test_flags_name_the_experts_or_leave_them_frozen_and_say_so(targets, dropout, want, frozen):
    settings = adapters.LoraSettings(targets=targets, dropout=dropout)
    assert adapters.resolve_targets(_mixtral(), settings) == want
    entry = adapters.manifest_entry(settings, _mixtral(), "causal-lm")
    assert frozen in entry["experts_frozen"] and "the fused experts stay frozen" in entry["experts_frozen"]
    from toolkit.train.report.progress import start_lines

    about = {"layout": {"dp": 1, "pp": 1, "tp": 1, "zero_stage": 0}, "model": "m", "model_name": "m", "from_dir": True,
             "dtype": "fp32", "params": 100, "trainable": 1, "mbs": 1, "gas": 1, "gbs": 1, "seq_len": 8, "lora": entry,
             "start_step": 0, "steps": 1, "seed": 0}
    assert f"LoRA: {entry['experts_frozen']}" in start_lines(about)  # the run's opening block


def test_flags_the_experts_cannot_take_are_refused():
    with pytest.raises(ConfigError, match=r"--lora-dropout 0.1 with --lora-targets naming fused expert parameters "
                                          r"\(mlp.experts.gate_up_proj\).*use --lora-dropout 0"):
        adapters.resolve_targets(_mixtral(), adapters.LoraSettings(targets=("gate_up_proj",), dropout=0.1))
    with pytest.raises(ConfigError, match="match no linear layer or fused expert parameter of MixtralForCausalLM; "
                                          ".*its fused expert parameters: mlp.experts.gate_up_proj"):
        adapters.resolve_targets(_mixtral(), adapters.LoraSettings(targets=("w1",)))


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_a_stage_injects_what_get_peft_model_injects(model_type):
    """Per decoder layer (adapters.StageAdapters, as a stage reading a directory does) and on the whole model: the same
    adapters by name and shape. deepseek_v3's dense and shared-expert gate/up/down_proj are names peft (transformers
    5) converts to the experts' (frozen; gate_up_proj at rank 2 r): both paths must convert alike."""
    settings = adapters.LoraSettings(r=4)
    layers = small_model(model_type, **SIX[model_type])
    config = adapters.peft_config(layers, settings, "causal-lm")
    staged = {}
    for i, layer in enumerate(layers.model.layers):
        adapted = adapters.StageAdapters(config, "causal-lm", seed=0)(layer, f"model.layers.{i}")
        staged |= {f"model.layers.{i}.{n}": tuple(p.shape) for n, p in adapted.named_parameters() if ".lora_" in n}
    whole = adapters.apply(small_model(model_type, **SIX[model_type]), settings, "causal-lm")
    want = {n.removeprefix(experts.PEFT_PREFIX): tuple(p.shape) for n, p in whole.named_parameters() if ".lora_" in n}
    assert staged == want and any("experts" in n for n in want)
    if model_type == "deepseek_v3":
        entry = adapters.manifest_entry(settings, small_model(model_type, **SIX[model_type]), "causal-lm")
        assert "the linears gate_proj, up_proj, down_proj stay frozen" in entry["experts_frozen"]
        gate_up = next(s for n, s in want.items() if n.endswith("experts.base_layer.lora_A.default.weight"))
        assert gate_up[0] == 2 * 4 * 4  # rank 2 r for each of the 4 experts


def _saved(folder: Path, model_type: str) -> Path:
    small_model(model_type, attn_implementation="eager", vocab_size=320, **SIX[model_type]).save_pretrained(folder)
    hf.byte_tokenizer().save_pretrained(folder)
    return folder


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


@pytest.mark.parametrize("zero", [0, 3])  # ZeRO-3: partitioned experts (ds_shape), parametrized at each forward
def test_a_pp1_lora_run_trains_the_experts_and_exports_what_peft_merges(ds_world1, tmp_path, zero):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.export.directory import export
    from toolkit.train.runner import TrainArgs, run

    base = _saved(tmp_path / "base", "mixtral")
    data = tmp_path / "docs.txt"
    data.write_text("\n\n".join(f"Document {i}: a fox met a frog by the river." * (1 + i % 3) for i in range(40)))
    cfg = write_config(tmp_path / "ds.json", mbs=2, gas=1, lr=1e-2, zero=zero, gradient_clipping=0.0)
    out = tmp_path / "run"
    run(TrainArgs(model=str(base), data=str(data), config=str(cfg), out=str(out), seq_len=32, steps=3, progress=False,
                  eval_fraction=0.05, lora=True, lora_r=4, attention="eager"))
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == sorted(EXPERTS)
    assert sorted(adapter["target_modules"]) == sorted(ATTENTION)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, out / "adapter").eval()
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = peft(input_ids=ids).logits
        want = {k: v.clone() for k, v in peft.merge_and_unload().state_dict().items()}
        got_logits = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()(input_ids=ids).logits
    assert (got_logits - want_logits).abs().max() < 1e-5
    on_disk, stored = _weights(out / "hf"), _weights(base)
    assert sorted(on_disk) == sorted(stored) and "model.layers.0.block_sparse_moe.experts.3.w1.weight" in on_disk
    moved = [k for k in stored if "experts" in k and not torch.equal(on_disk[k], stored[k])]
    assert len(moved) == 2 * 4 * 3  # every expert's w1, w2, w3 of both layers: the experts' adapters trained
    whole = export(out / "checkpoints", tmp_path / "whole", stream=False)  # the in-memory path: PEFT's own merge
    from transformers import AutoModelForCausalLM as Auto

    merged = Auto.from_pretrained(whole, dtype=torch.float32).state_dict()
    assert all(torch.equal(merged[k], want[k]) for k in want) and _weights(whole).keys() == on_disk.keys()
    streamed = Auto.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(streamed[k], want[k]) for k in want)  # the streamed merge: peft's fp32 arithmetic
