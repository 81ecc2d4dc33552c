"""What the wrappers do for activation checkpointing and frozen embeddings, without a process group:
which layer classes may be checkpointed, and the embedding's hidden state always carrying a graph."""

import pytest
import torch

import models
from models.pipeline import checkpointable_layers
from models.spec import needs_grad
from toolkit.plan.cost.profile import build_layers, sample_batch
from toolkit.train.parity import small_model

CASES = [("gpt2", None, {"GPT2BlockStage", "FinalNorm"}, "GPT2Embed"),
         ("llama", None, {"DecoderBlock", "FinalNorm"}, "EmbedStage"),
         ("bert", "masked-lm", {"BertLayerStage"}, "BertEnds"),
         ("bert", "sequence-classification", {"BertLayerStage"}, "BertEnds")]


@pytest.mark.parametrize("model_type, task, inner, embed", CASES)
def test_only_layers_fed_a_hidden_state_are_checkpointable(model_type, task, inner, embed):
    spec = models.pipeline_layers(small_model(model_type, task), task=task)
    names = checkpointable_layers(spec)
    assert set(names) == inner and embed not in names


@pytest.mark.parametrize("model_type, task", [(c[0], c[1]) for c in CASES])
def test_a_frozen_embedding_still_hands_on_a_hidden_state_with_a_graph(model_type, task):
    """Frozen embedding: the first layer's hidden state requires grad while autograd records (so a
    stage ending there can run backward, and a reentrant checkpoint after it trains its layers); the
    values are those of the trainable embedding; under no_grad nothing changes."""
    model = small_model(model_type, task)
    spec = models.pipeline_layers(model, task=task)
    first, module = build_layers(spec.layers[:1])[0]
    inputs, _ = sample_batch(model.config, seq_len=8, mbs=2)
    trained, mask = first(inputs)
    for p in module.parameters():  # token (and position, type) embeddings
        p.requires_grad_(False)
    frozen, frozen_mask = first(inputs)
    assert trained.requires_grad and frozen.requires_grad and frozen.grad_fn is None  # a leaf: nothing upstream trains
    assert torch.equal(frozen, trained.detach()) and torch.equal(frozen_mask, mask)
    with torch.no_grad():
        assert not first(inputs)[0].requires_grad


def test_needs_grad_leaves_integers_and_graphs_alone():
    ids = torch.arange(6).reshape(2, 3)
    assert needs_grad(ids) is ids and not ids.requires_grad
    x = torch.ones(2, requires_grad=True) * 2
    assert needs_grad(x) is x and x.grad_fn is not None
