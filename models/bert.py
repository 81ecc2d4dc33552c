"""BERT as [embeddings, L encoder layers, head]: masked LM (decoder tied to the word embeddings)
or sequence classification (pooler + classifier).

Inputs: (input_ids, attention_mask[, token_type_ids]), all (B, T) int64. Between stages:
(hidden (B, T, H), attention_mask (B, T)); each layer rebuilds the bidirectional padding mask.
"""

import torch.nn.functional as F
from torch import nn

from models.spec import PipelineSpec, classification_loss, masked_lm_loss, needs_grad


class BertEnds(nn.Module):
    """The tied module: embeddings (used by layer 0) and, for MLM, the prediction transform + bias
    (used by the last layer, whose decoder weight is the word embedding matrix)."""

    def __init__(self, source, prefix, mlm):
        super().__init__()
        self.embeddings = source.module(f"{prefix}.embeddings")
        if mlm:  # absent from base-model checkpoints (all-MiniLM): freshly initialised, as HF does
            self.transform = source.module("cls.predictions.transform", allow_missing=True)
            self.bias = source.parameter("cls.predictions.bias", allow_missing=True)

    def forward(self, inputs):
        token_type_ids = inputs[2] if len(inputs) > 2 else None
        return needs_grad(self.embeddings(input_ids=inputs[0], token_type_ids=token_type_ids)), inputs[1]


def mlm_logits(ends, inputs):
    """forward_fn of the MLM head: (hidden (B, T, H), mask) -> (B, T, V) via the tied word embeddings."""
    return F.linear(ends.transform(inputs[0]), ends.embeddings.word_embeddings.weight, ends.bias)


class BertLayerStage(nn.Module):
    """One BertLayer with the padding mask built by HF's create_bidirectional_mask."""

    def __init__(self, source, name, config):
        super().__init__()
        self.layer = source.module(name)
        self.config = config

    def forward(self, inputs):
        from transformers.masking_utils import create_bidirectional_mask

        hidden, attention_mask = inputs
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        out = self.layer(hidden, attention_mask=mask)
        return (out[0] if isinstance(out, tuple) else out), attention_mask


class BertClassifierHead(nn.Module):
    """Last layer for classification: (hidden, mask) -> pooler(hidden[:, 0]) -> dropout -> (B, C)."""

    def __init__(self, source, prefix):
        super().__init__()
        self.pooler = source.module(f"{prefix}.pooler")
        self.dropout = source.module("dropout")
        self.classifier = source.module("classifier", allow_missing=True)

    def forward(self, inputs):
        return self.classifier(self.dropout(self.pooler(inputs[0])))


def build_bert(source, config, task) -> PipelineSpec:
    """BertForMaskedLM or BertForSequenceClassification as L + 2 layers."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    model, prefix = source.skeleton, source.skeleton.base_model_prefix  # "bert"
    blocks = [f"{prefix}.encoder.layer.{i}" for i in range(config.num_hidden_layers)]
    mlm = task == "masked-lm"
    ends = [f"{prefix}.embeddings"] + (["cls.predictions.transform", "cls.predictions.bias"] if mlm else [])
    attr = ["embeddings.word_embeddings.weight"]
    if mlm:
        first = TiedLayerSpec("embed", BertEnds, source, prefix, True, tied_weight_attr=attr)
        last = TiedLayerSpec("embed", BertEnds, source, prefix, True, forward_fn=mlm_logits, tied_weight_attr=attr)
        head_names, loss = ends, masked_lm_loss
    else:
        first, last = LayerSpec(BertEnds, source, prefix, False), LayerSpec(BertClassifierHead, source, prefix)
        head_names, loss = [f"{prefix}.pooler", "classifier"], classification_loss
    layers = [first] + [LayerSpec(BertLayerStage, source, b, config) for b in blocks] + [last]
    hf_names = [ends] + [[b] for b in blocks] + [head_names]
    return PipelineSpec(layers=layers, loss_fn=loss, kinds=["embed"] + ["block"] * len(blocks) + ["head"],
                        config=config, task=task, tied={"embed": [0, len(layers) - 1]} if mlm else {},
                        param_counts=[_count(model, names) for names in hf_names], hf_names=hf_names)


def _count(model, names) -> int:
    """Parameters under HF names (modules or single parameters), each counted once."""
    seen = {}
    for name in names:
        try:
            params = list(model.get_submodule(name).parameters())
        except AttributeError:
            params = [model.get_parameter(name)]
        seen.update((id(p), p.numel()) for p in params)
    return sum(seen.values())
