"""Causal LMs without a base_model_pp_plan naming 'layers' (issue 16): the standard structure is read from
the module tree and the layer list computes what the HF model computes (fp32, 1e-5, right-padded and packed batches);
what is not standard is refused with the reason. The whole table is bench/results/arch_sweep.md."""

import pytest
import torch

import models
from toolkit.errors import ConfigError
from toolkit.train.parity import TOLERANCE, check_model, ensure_world_of_one, packed_batch, packed_vs_alone, small_model

# stablelm: partial rotary + LayerNorm; olmoe: MoE; gptj: layers in `h`, parallel attention/MLP
DISCOVERED = {"stablelm": {}, "olmoe": {"num_experts": 4, "num_experts_per_tok": 2}, "gptj": {"rotary_dim": 8}}


@pytest.mark.parametrize("model_type", DISCOVERED)
def test_discovered_structure_matches_hf(ds_world1, model_type):
    hf = small_model(model_type, attn_implementation="eager", **DISCOVERED[model_type])
    assert "layers" not in (getattr(hf.config, "base_model_pp_plan", None) or {})  # really the discovery path
    spec = models.pipeline_layers(hf)
    assert spec.kinds == ["embed", "block", "block", "norm", "head"]
    report = check_model(hf, name=model_type)
    assert report.ok and report.params_checked == len(list(hf.parameters())), report
    module = models.build_pipeline_module(spec, num_stages=1)
    inputs, labels, docs = packed_batch(hf.config)
    with torch.no_grad():
        logits = module(inputs)
        assert max(packed_vs_alone(logits, spec.loss_fn(logits, labels), hf, docs)) <= TOLERANCE


def test_discovered_model_loads_per_stage_from_a_directory(ds_world1, tmp_path):
    hf = small_model("stablelm")
    hf.save_pretrained(tmp_path)
    spec = models.pipeline_layers(str(tmp_path))
    assert spec.hf_names[1] == ["model.layers.0"] and spec.hf_names[-2] == ["model.norm"]
    ensure_world_of_one()
    module = models.build_pipeline_module(spec, num_stages=1)
    (ids, mask), labels = (torch.randint(1, 128, (2, 8)), torch.ones(2, 8, dtype=torch.long)), None
    with torch.no_grad():
        assert (module((ids, mask)) - hf(input_ids=ids, attention_mask=mask).logits).abs().max() <= TOLERANCE


@pytest.mark.parametrize("model_type, overrides, words", [
    # learned positions
    ("gpt_neo", {"num_layers": 2, "attention_types": [[["global", "local"], 1]]}, "also holds wpe (Embedding)"),
    ("falcon", {"alibi": True}, "takes ['alibi']"),
    ("mamba", {}, "holds a causal convolution (MambaMixer"),
    ("nanochat", {}, "applies norm before its decoder layers too"),
    ("gemma3", {}, "parameters outside its text decoder (model.multi_modal_projector, model.vision_tower)"),
    ("roberta", {"is_decoder": True}, "should hold one list of its 2 decoder layers; its lists: none"),
])
def test_what_is_not_standard_is_refused_with_the_reason(model_type, overrides, words):
    from transformers import AutoConfig

    from models.api import auto_class

    config = AutoConfig.for_model(model_type, **overrides)
    config.get_text_config().num_hidden_layers = 2
    with torch.device("meta"):
        hf = auto_class("causal-lm", config)._from_config(config)
    refusal = "has no base_model_pp_plan with 'layers' and dstk cannot read its decoder structure"
    with pytest.raises(ConfigError, match=refusal) as e:
        models.pipeline_layers(hf, task="causal-lm")
    assert words in str(e.value), str(e.value)
