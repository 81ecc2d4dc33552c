"""The streamed LoRA merge (toolkit.export.lora_merge) is peft's merge_and_unload, bit for bit, and writes
the directory the whole-model export writes. Its peak memory: tests/commands/test_peak_memory.py.

Checkpoints are fabricated as a pp = 1, fp32, ZeRO-0 LoRA run leaves them (mp_rank_00_model_states.pt's
module = the PeftModel's state dict), with lora_B drawn at random (training starts it at zero, which
would merge nothing); tests/unit/test_lora.py and tests/distributed/test_lora_pipeline.py export
real runs.
"""

from pathlib import Path

import pytest
import torch

from tests.unit.test_export_stream import read_weights
from models.lora import adapters
from toolkit.train import hf


def fabricate_lora_checkpoint(model, tokenizer, run: Path, base_dir: Path | None, seed: int = 0):
    """RUN/checkpoints as `dstk train --lora` at pp = 1 leaves it: the adapters alone when the base is a
    --model directory (`base_dir`, written here; base_saved False), else the whole PeftModel. Returns
    the PeftModel (r 4, alpha 8, every block linear), its lora_B drawn from `seed`."""
    from toolkit.checkpoint.manifest import save_meta, write_latest

    if base_dir is not None:
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    settings = adapters.LoraSettings(r=4, alpha=8)
    entry = adapters.manifest_entry(settings, model, "causal-lm")  # before peft wraps the model in place
    peft = adapters.apply(model, settings, "causal-lm", seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    state = {k: v.clone() for k, v in peft.state_dict().items() if base_dir is None or adapters.is_adapter(k)}
    ckpt = run / "checkpoints"
    (ckpt / "global_step1").mkdir(parents=True)
    torch.save({"module": state}, ckpt / "global_step1" / "mp_rank_00_model_states.pt")
    layout = {"pp": 1, "dp": 1, "tp": 1, "zero_stage": 0, "task": "causal-lm", "base_saved": base_dir is None,
              "model": None if base_dir is None else str(base_dir),
              "lora": settings.to_dict(), "lora_adapters": entry}  # as a run records them: the flags, the adapters
    save_meta(ckpt, model.config, tokenizer, layout)
    write_latest(ckpt, "global_step1")
    return peft


@pytest.mark.parametrize("name, from_dir", [("tiny-llama", True), ("tiny-gpt2", True), ("tiny-gpt2", False)])
def test_the_streamed_merge_is_peft_merge_and_unload_bit_for_bit(tmp_path, monkeypatch, name, from_dir):
    """Tolerance 0: the same fp32 operations as peft (W + transpose(B @ A, fan_in_fan_out) * alpha / r).
    tiny-gpt2's Conv1D is fan_in_fan_out; its base from the directory, or (a built-in model's run) from
    the checkpoint. The whole-model path is not taken."""
    from toolkit.export import directory as export_module
    from toolkit.export.directory import export

    monkeypatch.setattr(export_module, "_export_in_memory", lambda *a, **k: pytest.fail("loaded the whole model"))

    model, tok = hf.builtin_model(name), hf.byte_tokenizer()
    peft = fabricate_lora_checkpoint(model, tok, tmp_path / "run", tmp_path / "base" if from_dir else None)
    trained = {k: v.clone() for k, v in peft.state_dict().items() if ".lora_" in k}
    want = peft.merge_and_unload().state_dict()
    got = read_weights(export(tmp_path / "run", tmp_path / "hf", adapter_dir=tmp_path / "ad", max_shard_size="60KB"))
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1  # sharded
    assert got.keys() <= want.keys() and len(got) >= len(want) - 1  # less a tied head
    changed = [k for k, v in got.items() if not torch.equal(v, want[k])]
    assert not changed, changed[:4]
    saved = read_weights_file(tmp_path / "ad" / "adapter_model.safetensors")
    assert trained.keys() == {k.replace(".weight", ".default.weight") for k in saved}
    assert all(torch.equal(saved[k], trained[k.replace(".weight", ".default.weight")]) for k in saved)


def read_weights_file(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("dtype, merge", [("bf16", True), ("fp32", False)])
def test_the_streamed_lora_export_writes_the_whole_exports_directory(tmp_path, dtype, merge):
    """Every file the whole-model export writes, with the same bytes (the index aside: shards are filled
    in state-dict order), and the same tensors by name and dtype; with --no-merge the adapters alone."""
    from toolkit.export.directory import export

    model, tok = hf.builtin_model("tiny-llama"), hf.byte_tokenizer()
    fabricate_lora_checkpoint(model, tok, tmp_path / "run", tmp_path / "base")
    for kind, stream in (("whole", False), ("streamed", True)):
        export(tmp_path / "run", tmp_path / kind, dtype=dtype, merge=merge, stream=stream, max_shard_size="60KB",
               adapter_dir=(tmp_path / f"{kind}_ad") if merge else None)
    for kind in ("", "_ad"):
        whole, streamed = tmp_path / f"whole{kind}", tmp_path / f"streamed{kind}"
        if not whole.exists():
            continue
        names = sorted(p.name for p in whole.iterdir())
        assert names == sorted(p.name for p in streamed.iterdir())
        for f in names:
            if not f.endswith((".safetensors", ".index.json")):
                assert (whole / f).read_bytes() == (streamed / f).read_bytes(), f
        adapters_only = (whole / "adapter_model.safetensors").exists()
        read = (lambda d: read_weights_file(d / "adapter_model.safetensors")) if adapters_only else read_weights
        a, b = read(whole), read(streamed)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
        if adapters_only:  # PEFT loads them onto the base the run started from (not the checkpoint's dstk/ folder)
            import json

            from peft import AutoPeftModelForCausalLM

            config = json.loads((streamed / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == str(tmp_path / "base"), config
            loaded = AutoPeftModelForCausalLM.from_pretrained(streamed)
            assert sum(".lora_A." in n for n, _ in loaded.named_parameters()) == len(a) // 2


def test_the_streamed_merge_of_adapted_fused_experts_is_peft_merge_and_unload(tmp_path, monkeypatch):
    """deepseek_v3's default targets name gate_proj/up_proj/down_proj (its dense first layer's): peft 0.21 then adapts
    the fused experts in their place (ParamWrapper over gate_up_proj and down_proj, nested in one module: its
    transformers-v5 conversion of the targets), whose delta is per expert. The streamed merge equals peft's
    merge_and_unload bit for bit, written under save_pretrained's per-expert names; the experts changed."""
    from transformers import AutoModelForCausalLM

    from tests.moe_models import tiny_moe
    from toolkit.export import directory as export_module
    from toolkit.export.directory import export

    monkeypatch.setattr(export_module, "_export_in_memory", lambda *a, **k: pytest.fail("loaded the whole model"))
    model = tiny_moe("deepseek_v3")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft = fabricate_lora_checkpoint(model, hf.byte_tokenizer(), tmp_path / "run", tmp_path / "base")
    assert any(".experts.base_layer.lora_A." in k for k in peft.state_dict())  # two wrappers, one module
    want = peft.merge_and_unload().state_dict()
    out = export(tmp_path / "run", tmp_path / "hf", max_shard_size="60KB")
    assert any(".experts.0." in k for k in read_weights(out))  # per-expert names on disk
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(got[experts], base[experts])


def test_an_adapter_the_recorded_settings_do_not_make_is_refused_not_dropped(tmp_path):
    """peft records the targets it kept after moving gate_proj/up_proj/down_proj onto the experts; a manifest holding
    those (not the targets asked for) rebuilds no experts' adapters: the export refuses, naming one, rather than
    writing a merge without them."""
    import json

    from tests.moe_models import tiny_moe
    from toolkit.errors import ConfigError
    from toolkit.export.directory import export

    peft = fabricate_lora_checkpoint(tiny_moe("deepseek_v3"), hf.byte_tokenizer(), tmp_path / "run", tmp_path / "base")
    manifest = tmp_path / "run" / "checkpoints" / "dstk" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["lora_adapters"].update(targets=sorted(peft.peft_config["default"].target_modules), parameters=[])
    # (attention only, no expert parameter: settings that do not make the experts' adapters)
    manifest.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.experts\..*lora_A\.default\.weight: an adapter the run's "
                                          "recorded LoRA settings do not make"):
        export(tmp_path / "run", tmp_path / "hf")
