"""MoE causal LMs through the pipeline wrappers (issue 16). The router's auxiliary (load-balancing) loss:
HF adds it only with output_router_logits (false in released checkpoints and by default): then the loss
is the LM loss alone and the wrappers compute it exactly, routing included (top-k experts per token, the
experts' gradients). With output_router_logits true, the term spans every layer's router logits, which
pipeline stages do not send: the wrappers refuse; at pp = 1 dstk trains the HF model itself, which adds it."""

import pytest

import models
from toolkit.errors import ConfigError
from toolkit.train.parity import check_model, small_model

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
def test_router_aux_loss_in_the_loss_is_refused_with_the_way_out(model_type):
    hf = small_model(model_type, output_router_logits=True, **MOE[model_type])
    with pytest.raises(ConfigError, match="output_router_logits is true") as e:
        models.pipeline_layers(hf)
    assert "router_aux_loss_coef" in str(e.value) and "train at pp 1" in str(e.value)
    out = hf(input_ids=hf.dummy_inputs["input_ids"] % 100, labels=hf.dummy_inputs["input_ids"] % 100)
    assert out.aux_loss is not None and out.aux_loss > 0  # what the pipeline would have left out
