"""LoRA at pp = 1 through peft: only the adapters train, and the export loads with PEFT and merges exactly."""

import json
from pathlib import Path

import pytest
import torch

from tests.configs import SHORT_EVAL, write_config
from toolkit.errors import ConfigError
from models.lora import adapters
from models.weights import loading
from toolkit.train import hf, lora

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"


def _base_and_config(tmp_path, **ds) -> tuple:
    """(a saved tiny-llama directory with the byte tokenizer, a DeepSpeed config file: mbs 2, AdamW lr 1e-2 + `ds`)."""
    base_dir = tmp_path / "base"
    hf.builtin_model("tiny-llama").save_pretrained(base_dir)
    hf.byte_tokenizer().save_pretrained(base_dir)
    return base_dir, write_config(tmp_path / "ds.json", mbs=2, gas=1, lr=1e-2, **ds)


def _merge_gap(merged_dir, base_dir, adapter_dir) -> float:
    """Largest logit difference between the merged export and PeftModel.from_pretrained(base, adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(input_ids=ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
        return float((merged - peft(input_ids=ids).logits).abs().max())


@pytest.mark.parametrize("name, expected", [
    ("tiny-llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("tiny-gpt2", ["c_attn", "c_proj", "c_fc"]),
])
def test_default_targets_are_every_block_linear(name, expected):
    assert sorted(adapters.linear_names(hf.builtin_model(name))) == sorted(expected)


def test_a_target_that_matches_nothing_lists_the_linears():
    with pytest.raises(ConfigError, match=r"--lora-targets qkv match no linear layer of LlamaForCausalLM; its block "
                                          r"linears are: q_proj, k_proj"):
        adapters.resolve_targets(hf.builtin_model("tiny-llama"), adapters.LoraSettings(targets=("qkv",)))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_only_adapters_train_and_the_export_loads_with_peft(ds_world1, tmp_path, zero):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.train.runner import TrainArgs, run

    base_dir = tmp_path / "base"
    base = hf.builtin_model("tiny-llama")
    base.save_pretrained(base_dir)
    hf.byte_tokenizer().save_pretrained(base_dir)
    cfg = write_config(tmp_path / "ds.json", mbs=2, gas=1, lr=1e-2, zero=zero, gradient_clipping=0.0)
    out = tmp_path / "run"
    summary = run(TrainArgs(model=str(base_dir), data=str(CORPUS), config=str(cfg), out=str(out), seq_len=32, steps=3,
                            progress=False, eval_fraction=SHORT_EVAL, lora=True, lora_r=4))
    assert summary["last_loss"] < summary["first_loss"]
    groups = json.loads((out / "checkpoints" / "dstk" / "manifest.json").read_text())["param_groups"]
    assert groups and all(".lora_A." in n or ".lora_B." in n for g in groups for n in g)  # the optimizer's only
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)  # PEFT's key names, adapters only
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir).eval(), out / "adapter").eval()
        untouched = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        got, want, before = (m(input_ids=ids).logits for m in (merged, peft, untouched))
    assert (got - want).abs().max() < 1e-4  # the merged weights are base + the adapters, as PEFT computes
    assert (got - before).abs().max() > 1e-3  # and the adapters learned something


def test_qlora_is_refused_without_cuda_once_with_the_way_out(tmp_path):
    """This machine has no CUDA: --qlora is refused before any model is built, in one line, no traceback."""
    from tests.unit.test_train_refusals import train_entry

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}))
    run = train_entry(["--config", str(cfg), "--model", "tiny-llama", "--data", str(CORPUS),
                       "--out", str(tmp_path / "run"), "--qlora"], env={"DS_ACCELERATOR": "cpu"})
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("--qlora: the 4-bit base needs a CUDA GPU") == 1, run.stderr[-2000:]
    assert "train with --lora here" in run.stderr and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("pp, zero, words", [(2, 0, "--qlora with pp 2"), (1, 3, "--qlora with zero_optimization.stage 3")])
def test_qlora_layouts_it_cannot_run_are_refused(pp, zero, words):
    with pytest.raises(ConfigError, match=words):
        lora.check(adapters.LoraSettings(qlora=True), pp, zero)


def test_a_qlora_checkpoint_exports_onto_the_full_precision_base(ds_world1, tmp_path):
    """A QLoRA checkpoint's base is 4-bit: export takes the adapters from it and merges them into the run's
    --model directory. The checkpoint here is a LoRA run's whose layout says qlora (no CUDA to quantize): the
    adapters are real; its fp32 base is ignored by the export, which reads the directory's."""
    from toolkit.errors import UnusableInput
    from toolkit.export.directory import export
    from toolkit.train.runner import TrainArgs, run

    base_dir, cfg = _base_and_config(tmp_path)
    out = tmp_path / "run"
    run(TrainArgs(model=str(base_dir), data=str(CORPUS), config=str(cfg), out=str(out), seq_len=32, steps=2,
                  progress=False, eval_fraction=SHORT_EVAL, lora=True, lora_r=4, export=False))
    manifest_file = out / "checkpoints" / "dstk" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest["model"] == str(base_dir.resolve())
    for own in (out / "checkpoints").glob("*/dstk-manifest.json"):
        own.unlink()  # each tag's copy of the manifest: the edits below go to the run's only
    manifest["lora"]["qlora"] = True
    manifest_file.write_text(json.dumps(manifest))
    export(out, tmp_path / "hf", adapter_dir=tmp_path / "adapter")
    assert _merge_gap(tmp_path / "hf", base_dir, tmp_path / "adapter") < 1e-5
    manifest["model"] = str(tmp_path / "gone")
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(UnusableInput, match="holds its base in 4 bits only"):
        export(out, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_dstk_export_writes_the_adapters_alone_or_beside_the_merge(ds_world1, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from toolkit.cli import cli
    from toolkit.train.runner import TrainArgs, run

    cfg = write_config(tmp_path / "ds.json", mbs=2, gas=1, lr=1e-2)
    out = tmp_path / "run"
    run(TrainArgs(model="tiny-llama", data=str(CORPUS), config=str(cfg), out=str(out), seq_len=32, steps=2,
                  progress=False, eval_fraction=SHORT_EVAL, lora=True, lora_r=4))
    runner = CliRunner()
    alone = runner.invoke(cli, ["export", str(out), str(tmp_path / "alone"), "--no-merge"])
    assert alone.exit_code == 0, alone.output
    both = runner.invoke(cli, ["export", str(out), str(tmp_path / "merged"), "--adapter-dir", str(tmp_path / "ad")])
    assert both.exit_code == 0, both.output
    trained = load_file(out / "adapter" / "adapter_model.safetensors")
    for folder in (tmp_path / "alone", tmp_path / "ad"):
        got = load_file(folder / "adapter_model.safetensors")
        assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in got)
        assert (folder / "tokenizer.json").exists() and not (folder / "model.safetensors").exists()
    assert (tmp_path / "merged" / "model.safetensors").exists() and not (tmp_path / "merged" / "adapter").exists()
    full = tmp_path / "full"
    run(TrainArgs(model="tiny-llama", data=str(CORPUS), config=str(cfg), out=str(full), seq_len=32, steps=1,
                  progress=False, eval_fraction=SHORT_EVAL, export=False))
    refused = runner.invoke(cli, ["export", str(full), str(tmp_path / "nothing"), "--no-merge"])
    assert refused.exit_code != 0 and "--no-merge: " in str(refused.exception) and "not a LoRA run" in str(refused.exception)
    assert not (tmp_path / "nothing").exists()


def test_a_bf16_run_merges_its_adapters_into_the_exact_base(ds_world1, tmp_path):
    """Under bf16 the checkpoint holds the frozen base rounded to bf16 (no fp32 masters for frozen
    weights); the export takes the base from the run's --model directory, so OUT/hf is exactly
    base + adapters, what PeftModel.from_pretrained(base, OUT/adapter) computes."""
    from toolkit.train.runner import TrainArgs, run

    base_dir, cfg = _base_and_config(tmp_path, bf16=True)
    out = tmp_path / "run"
    run(TrainArgs(model=str(base_dir), data=str(CORPUS), config=str(cfg), out=str(out), seq_len=32, steps=2,
                  progress=False, eval_fraction=SHORT_EVAL, lora=True, lora_r=4))
    assert _merge_gap(out / "hf", base_dir, out / "adapter") < 1e-5


def test_a_pipeline_stage_without_adapters_is_refused(ds_world1):
    """tiny-gpt2 at pp 3 with parts [0, 1, 4, 5]: stage 0 is the frozen embedding alone."""
    from toolkit.distributed.topology import Topology
    from toolkit.distributed.pipeline import pipeline_module

    config = hf.load_config("tiny-gpt2", hf.byte_tokenizer(), "causal-lm")
    model = adapters.apply(loading.build_model("tiny-gpt2", config, "causal-lm", 0), adapters.LoraSettings(r=2), "causal-lm")
    cfg = {"pipeline": {"stages": 3, "parts": [0, 1, 4, 5]}}
    topo = Topology(3, 3)
    with pytest.raises(ConfigError, match=r"pipeline stage 0 holds layers 0-0 \(embed\) and no adapters"):
        pipeline_module(model.base_model.model, "causal-lm", topo, cfg, config=config, lora=adapters.LoraSettings(r=2))


@pytest.mark.parametrize("flags, words", [(dict(merge=False, adapter_dir="ad"), "--adapter-dir with --no-merge"),
                                          (dict(adapter_dir="OUT"), "is OUT_DIR")])
def test_export_adapter_flags_that_cannot_both_hold_are_refused(tmp_path, flags, words):
    from toolkit.export.directory import check_adapter_flags

    flags = {k: (tmp_path / v if k == "adapter_dir" else v) for k, v in flags.items()}
    with pytest.raises(ConfigError, match=words):
        check_adapter_flags(tmp_path, tmp_path / "OUT", flags.get("adapter_dir"), flags.get("merge", True), True)
    with pytest.raises(ConfigError, match="--adapter-dir: .* is not a LoRA run"):
        check_adapter_flags(tmp_path, tmp_path / "OUT", tmp_path / "ad", True, False)


@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.heavy)])  # ZeRO-3: ~1 min in one process
def test_a_lora_run_saves_its_adapters_only_and_resumes_exactly(ds_world1, tmp_path, zero):
    """From a directory the checkpoint leaves the frozen base out (it is re-read from --model): 2 + 2
    resumed steps give the 4-step run's losses."""
    from toolkit.train.runner import TrainArgs, run

    base_dir, cfg = _base_and_config(tmp_path, zero_optimization={"stage": zero})

    def train(out, steps, resume=False):
        run(TrainArgs(model=str(base_dir), data=str(CORPUS), config=str(cfg), out=str(out), seq_len=32, steps=steps,
                      progress=False, eval_fraction=SHORT_EVAL, lora=True, lora_r=4, export=False, resume=resume))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "step" in r}

    straight = train(tmp_path / "straight", 4)
    train(tmp_path / "resumed", 2)
    sizes = sum(f.stat().st_size for f in (tmp_path / "resumed" / "checkpoints" / "global_step2").iterdir())
    resumed = train(tmp_path / "resumed", 4, resume=True)
    assert all(abs(resumed[s] - straight[s]) <= 1e-5 * abs(straight[s]) for s in (3, 4)), (resumed, straight)
    base_bytes = sum(p.numel() * 4 for p in hf.builtin_model("tiny-llama").parameters())
    assert sizes < base_bytes, (sizes, base_bytes)  # adapters and their Adam states, not another copy of the base
