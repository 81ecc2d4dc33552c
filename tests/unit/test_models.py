"""The wrapped layer lists compute what the HF models compute, as a real single-stage
PipelineModule in a gloo world of one (small random configs, fp32, dropout off)."""

import pytest

from toolkit.errors import ConfigError, UnusableInput
from toolkit.train.parity import TOLERANCE, check_model, small_model

CASES = [  # (model_type, task, config overrides)
    ("llama", None, {}),
    ("gpt2", None, {}),
    ("bert", "masked-lm", {}),
    ("bert", "sequence-classification", {"num_labels": 3}),
    ("qwen2", None, {"tie_word_embeddings": True}),
    ("mistral", None, {"sliding_window": 4}),  # window < seq_len 8: the sliding mask matters
    ("gemma2", None, {"sliding_window": 4, "final_logit_softcapping": 5.0}),
    ("phi3", None, {}),
    ("gemma3_text", None, {"sliding_window": 4}),  # rotary per layer type, scaled embedding
    ("gpt_neox", None, {}),
]


@pytest.mark.parametrize("model_type,task,overrides", CASES, ids=lambda c: c if isinstance(c, str) else None)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_pipeline_matches_hf_with_and_without_padding(ds_world1, model_type, task, overrides, attn):
    if model_type == "gemma2" and attn == "sdpa":
        pytest.skip("HF refuses sdpa for gemma2 (attention softcapping)")
    model = small_model(model_type, task, attn_implementation=attn, **overrides)
    for pad in (False, True):
        report = check_model(model, model_type, task=task, pad=pad)
        assert report.params_checked == len(list(model.parameters()))  # every parameter compared
        assert report.loss_diff <= TOLERANCE, report
        assert report.logits_diff <= TOLERANCE, report
        assert report.grad_diff <= TOLERANCE, report


def test_padding_changes_the_result(ds_world1):
    """The padding mask reaches the layers: the unpadded row's loss must not depend on pad tokens."""
    import torch

    import models
    from toolkit.train.parity import batch

    model = small_model("llama", attn_implementation="eager")
    layers_module = models.build_pipeline_module(models.pipeline_layers(model), num_stages=1)
    (ids, mask), _ = batch(model.config, "causal-lm", pad=True)
    first = layers_module((ids, mask))
    ids2 = ids.clone()
    ids2[0, -3:] = 7  # change only tokens under the padding mask (at the end: causal, so no effect)
    ids2[1, -1] = 7  # change the last token of an unpadded row: earlier positions unaffected
    second = layers_module((ids2, mask))
    assert torch.allclose(first[0, :5], second[0, :5]) and torch.allclose(first[1, :7], second[1, :7])
    left = mask.clone()
    left[0] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])  # left padding: later tokens must ignore 0..2
    out_a = layers_module((ids, left))
    ids3 = ids.clone()
    ids3[0, :3] = 9
    assert torch.allclose(out_a[0, 3:], layers_module((ids3, left))[0, 3:], atol=1e-6)


@pytest.mark.parametrize("model_type,task,n_extra,kinds_tail", [
    ("llama", None, 3, ["norm", "head"]), ("gpt2", None, 3, ["norm", "head"]),
    ("bert", "masked-lm", 2, ["head"]), ("bert", "sequence-classification", 2, ["head"])])
def test_layer_list_shape_kinds_and_ties(model_type, task, n_extra, kinds_tail):
    from deepspeed.pipe import TiedLayerSpec

    import models

    spec = models.pipeline_layers(small_model(model_type, task, num_hidden_layers=3), task=task)
    layers, loss_fn = spec
    assert spec.num_layers == len(layers) == 3 + n_extra and loss_fn is spec.loss_fn
    assert spec.kinds == ["embed", "block", "block", "block"] + kinds_tail
    tied = isinstance(layers[0], TiedLayerSpec)
    assert tied == (task != "sequence-classification" and model_type != "llama")
    assert spec.tied == ({"embed": [0, spec.num_layers - 1]} if tied else {})
    assert len(spec.param_counts) == spec.num_layers and all(c > 0 for c in spec.param_counts)


def test_given_parts_are_used_and_bad_parts_refused(ds_world1):
    import models

    spec = models.pipeline_layers(small_model("llama"))
    module = models.build_pipeline_module(spec, parts=[0, spec.num_layers])
    assert module.parts == [0, 5] and len(module.forward_funcs) == 5
    for parts, words in [([0, 2, 5], "3 boundaries; 1 stages"), ([1, 5], "start at 0"), ([0, 4], "num_layers = 5")]:
        with pytest.raises(ConfigError, match=words):
            models.build_pipeline_module(spec, num_stages=1, parts=parts)
    with pytest.raises(ConfigError, match="no layers"):
        models.check_parts([0, 3, 3, 5], 3, 5)


def test_unwrappable_models_get_clear_errors(tmp_path):
    import models

    with pytest.raises(ConfigError, match="base_model_pp_plan"):
        models.pipeline_layers(small_model("mamba"))
    with pytest.raises(ConfigError, match="task 'masked-lm'"):
        models.pipeline_layers(small_model("llama"), task="masked-lm")
    with pytest.raises(ConfigError, match="seq_len 100 > max_position_embeddings 64"):
        models.pipeline_layers(small_model("gpt2"), seq_len=100)
    with pytest.raises(UnusableInput, match="no such directory"):
        models.pipeline_layers(str(tmp_path / "absent"))
    with pytest.raises(UnusableInput, match="no config.json"):
        models.pipeline_layers(str(tmp_path))
