"""MoE causal LMs through the pipeline wrappers (issue 16). The router's auxiliary (load-balancing) loss:
HF adds it only with output_router_logits (false in released checkpoints and by default): then the loss
is the LM loss alone and the wrappers compute it exactly, routing included (top-k experts per token, the
experts' gradients). With output_router_logits true, HF adds coef x a load-balancing term over every
layer's router logits: the wrappers carry its sums between stages (models/moe.py) and give HF's loss and
router gradients; at pp = 1 dstk trains the HF model itself, which adds it. The 2-stage case is in
tests/distributed/test_pipeline_models.py."""

import pytest

import models
from toolkit.errors import ConfigError
from toolkit.train.parity import batch, check_model, small_model

MOE = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
       "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 64},
       "olmoe": {"num_experts": 4, "num_experts_per_tok": 2}}


@pytest.mark.parametrize("model_type", MOE)
def test_moe_routing_and_expert_gradients_match_hf(ds_world1, model_type):
    hf = small_model(model_type, attn_implementation="eager", **MOE[model_type])
    report = check_model(hf, name=model_type)
    experts = [n for n, p in hf.named_parameters() if "experts" in n]
    assert experts and report.params_checked == len(list(hf.parameters()))  # every expert's gradient compared
    assert report.ok, report


@pytest.mark.parametrize("model_type", MOE)
def test_router_aux_loss_is_carried_between_stages_exactly(ds_world1, model_type):
    """output_router_logits: HF's loss is CE + coef * load balancing over every layer's routers; the layer
    list's equals it, and every router's gradient (which the aux term changes) matches."""
    hf = small_model(model_type, attn_implementation="eager", output_router_logits=True, router_aux_loss_coef=0.5,
                     **MOE[model_type])
    inputs, labels = batch(hf.config, "causal-lm")
    out = hf(input_ids=inputs[0], attention_mask=inputs[1], labels=labels)
    assert out.aux_loss > 0.5  # a term the check below would see missing (0.5 x aux)
    report = check_model(hf, name=model_type)
    assert report.params_checked == len(list(hf.parameters())) and report.ok, report
    spec = models.pipeline_layers(hf)
    assert spec.loss_fn.__self__.num_experts == 4  # the aux-aware loss, not the plain cross entropy


def test_an_aux_loss_of_another_form_is_refused(monkeypatch):
    import transformers.models.mixtral.modeling_mixtral as mixtral

    hf = small_model("mixtral", output_router_logits=True, **MOE["mixtral"])
    original = mixtral.load_balancing_loss_func
    monkeypatch.setattr(mixtral, "load_balancing_loss_func", lambda *a: 2 * original(*a))
    with pytest.raises(ConfigError, match="not the Mixtral-style load-balancing sum"):
        models.pipeline_layers(hf)
