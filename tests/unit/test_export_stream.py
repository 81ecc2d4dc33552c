"""`dstk export` streams: sharded safetensors + index written about one layer at a time, the same
tensors (bit for bit) as the whole-model export, and refusals that leave nothing. Its peak RSS,
bounded by the largest layer, is measured on a child process: tests/commands/test_peak_memory.py.

Pipeline checkpoints are written in this process the way DeepSpeed's PipelineModule.save_state_dict
writes one (fabricate_pipeline_checkpoint; tests/distributed/test_export_stream.py checks that
against a real 2-process run); a real launch of 200M parameters takes minutes on 2 shared cores.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.configs import SHORT_EVAL
from toolkit.cli import main
from toolkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"


def fabricate_pipeline_checkpoint(model, tokenizer, ckpt_dir: Path, pp: int, tag: str = "global_step1") -> dict:
    """CKPT_DIR as `dstk train` at `pp` stages leaves it (fp32, no optimizer files): per pipeline layer
    the torch.save of its state_dict, as PipelineModule.save_state_dict does (a TiedLayerSpec with a
    forward_fn runs as a function of the tied module and has no file), dstk/ with the real layout."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    import models
    from toolkit.checkpoint.manifest import save_meta, write_latest
    from toolkit.distributed.pipeline import choose_parts, hf_name_map

    spec = models.pipeline_layers(model, task="causal-lm")
    parts, _ = choose_parts(spec, pp, {}, 32)
    (ckpt_dir / tag).mkdir(parents=True)
    tied = {}
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, TiedLayerSpec):
            first = layer.key not in tied
            module = tied.setdefault(layer.key, layer.build())
            saved = module if layer.forward_fn is None or first else None
        else:
            saved = layer.build() if isinstance(layer, LayerSpec) else layer
        if isinstance(saved, torch.nn.Module):
            torch.save({k: v.clone() for k, v in saved.state_dict().items()}, ckpt_dir / tag / f"layer_{i:02d}-model_states.pt")
    layout = {"pp": pp, "parts": parts, "hf_names": hf_name_map(spec), "tied": dict(spec.tied), "task": "causal-lm",
              "base_saved": True, "lora": None}
    save_meta(ckpt_dir, model.config, tokenizer, layout)
    write_latest(ckpt_dir, tag)
    return layout


def gpt2(n_embd: int, n_layer: int, tokenizer, seed: int = 0):
    from transformers import GPT2Config

    from models.weights.loading import random_model

    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64), vocab_size=len(tokenizer),
                        n_positions=64, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return random_model(config, seed=seed).eval()


def read_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    return {k: v for f in files for k, v in load_file(folder / f).items()}


def test_sizes_read_like_hf():
    from toolkit.export.stream import parse_size

    assert [parse_size(s) for s in ("5GB", "500MB", "1.5GiB", "100KB", 4096, "4096")] == \
        [5 * 10**9, 500 * 10**6, int(1.5 * 2**30), 100_000, 4096, 4096]
    for bad in ("lots", "-1GB", "0", "5XB"):
        with pytest.raises(ConfigError, match="--max-shard-size .* such as 500MB"):
            parse_size(bad)


@pytest.mark.parametrize("limit", [1, 20_000, 200_000, 10**9])
def test_shards_split_where_huggingface_hub_splits(limit):
    from huggingface_hub import split_torch_state_dict_into_shards

    from toolkit.export.stream import plan_shards
    from toolkit.train.parity import small_model

    state = {k: v for k, v in small_model("gpt2").state_dict().items() if k != "lm_head.weight"}
    theirs = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    mine = plan_shards({k: v.numel() * v.element_size() for k, v in state.items()}, limit)
    assert [sorted(names) for names in mine] == [sorted(names) for names in theirs.filename_to_tensors.values()]


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_pp1_checkpoints_stream_the_in_memory_exports_tensors(ds_world1, tmp_path, zero):
    """bf16 training (masters in the optimizer files) of a tied GPT-2: the streamed, sharded export
    holds exactly the tensors and config of the whole-model export, in fp32 and in bf16."""
    from transformers import AutoModelForCausalLM

    from toolkit.export.directory import export
    from toolkit.train.runner import TrainArgs, run

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                               "gradient_clipping": 0.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": zero},
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}))
    run(TrainArgs(model="tiny-gpt2", data=str(CORPUS), config=str(cfg), out=str(tmp_path / "run"), seq_len=32,
                  steps=2, progress=False, eval_fraction=SHORT_EVAL, export=False))
    for dtype in ("fp32", "bf16"):
        export(tmp_path / "run", tmp_path / f"whole_{dtype}", dtype=dtype, stream=False)
        export(tmp_path / "run", tmp_path / f"streamed_{dtype}", dtype=dtype, max_shard_size="100KB")
        whole, streamed = read_weights(tmp_path / f"whole_{dtype}"), read_weights(tmp_path / f"streamed_{dtype}")
        assert whole.keys() == streamed.keys() and "lm_head.weight" not in streamed
        assert all(torch.equal(whole[k], streamed[k]) and whole[k].dtype == streamed[k].dtype for k in whole)
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / f"whole_{dtype}" / name).read_text() == (tmp_path / f"streamed_{dtype}" / name).read_text()
    shards = sorted(p.name for p in (tmp_path / "streamed_fp32").glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed_fp32")
    assert torch.equal(reloaded.lm_head.weight, read_weights(tmp_path / "whole_fp32")["transformer.wte.weight"])


@pytest.fixture
def pp1_checkpoint(tmp_path):
    """A pp = 1 checkpoint (module states only) of a tiny GPT-2; returns (run folder, its .pt file)."""
    from toolkit.train import hf
    from toolkit.checkpoint.manifest import save_meta, write_latest

    tok = hf.byte_tokenizer()
    model = gpt2(64, 2, tok)
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "global_step1").mkdir(parents=True)
    pt = ckpt / "global_step1" / "mp_rank_00_model_states.pt"
    torch.save({"module": model.state_dict()}, pt)
    save_meta(ckpt, model.config, tok, {"task": "causal-lm", "pp": 1})
    write_latest(ckpt, "global_step1")
    return tmp_path / "run", pt


@pytest.mark.parametrize("damage, words", [
    ("drop", "does not match its model: missing ['transformer.h.1.mlp.c_fc.weight']"),
    ("shape", "transformer.h.1.mlp.c_fc.weight: the checkpoint holds shape (64, 128), the model expects (64, 256)"),
    ("extra", "does not match its model: missing [], unexpected ['transformer.h.9.mlp.c_fc.weight']"),
])
def test_a_missing_misshapen_or_foreign_tensor_is_refused_leaving_nothing(capsys, pp1_checkpoint, damage, words):
    run, pt = pp1_checkpoint
    saved = torch.load(pt)
    key = "transformer.h.1.mlp.c_fc.weight"
    if damage == "drop":
        del saved["module"][key]
    elif damage == "shape":
        saved["module"][key] = saved["module"][key][:, :128].clone()
    else:
        saved["module"]["transformer.h.9.mlp.c_fc.weight"] = saved["module"][key]
    torch.save(saved, pt)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(run), str(run.parent / "hf")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and words in err and "Traceback" not in err, err
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no hf/, no temp folder


def test_a_bad_shard_size_is_refused_before_anything_is_read(capsys, pp1_checkpoint):
    run, _ = pp1_checkpoint
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(run), str(run.parent / "hf"), "--max-shard-size", "lots"])
    assert exit_info.value.code == 1 and "--max-shard-size 'lots'" in capsys.readouterr().err


def test_one_shard_is_model_safetensors_without_an_index(pp1_checkpoint):
    from safetensors import safe_open

    from toolkit.export.directory import export

    run, _ = pp1_checkpoint
    out = export(run, run.parent / "hf")
    assert not (out / "model.safetensors.index.json").exists()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"} and "lm_head.weight" not in f.keys()
