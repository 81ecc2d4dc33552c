"""The result of wrapping a model (`PipelineSpec`) and the losses the last stage computes.

Losses take what the pipeline's last layer returns and the labels the data iterator yields:
causal LM: logits (B, T, V) and labels (B, T) with -100 ignored, shifted by one inside (as HF);
masked LM: logits (B, T, V), labels (B, T), not shifted; classification: logits (B, C), labels (B,).
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

KINDS = ("embed", "block", "norm", "head")


@dataclass
class PipelineSpec:
    """A HF model as a pipeline layer list. `layers, loss_fn = spec` unpacks it.

    layers: entries for deepspeed.pipe.PipelineModule (nn.Module, LayerSpec or TiedLayerSpec).
    loss_fn: loss_fn(outputs, labels) -> scalar tensor.
    kinds: per layer, one of KINDS, so a partitioner can attach costs.
    tied: tie key -> indices of the layers sharing that module, e.g. {"embed": [0, 14]}.
    param_counts: trainable parameters per layer, counted without building any layer
        (a tied module counts at every index it appears, as DeepSpeed counts it).
    hf_names: per layer, the HF module names it holds (for checkpoint conversion).
    """

    layers: list
    loss_fn: Callable
    kinds: list
    config: object
    task: str
    tied: dict = field(default_factory=dict)
    param_counts: list = field(default_factory=list)
    hf_names: list = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter((self.layers, self.loss_fn))

    def __post_init__(self):
        if len(self.kinds) != len(self.layers):
            raise ValueError(f"{len(self.kinds)} kinds for {len(self.layers)} layers")


def needs_grad(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden state an embedding layer returns, made to require grad while autograd records even
    when nothing before it is trainable (a frozen embedding). Otherwise the stage's output has no
    graph, and its backward fails ("element 0 of tensors does not require grad", DeepSpeed #688),
    and a reentrant activation checkpoint over the next layers gives their parameters no gradient."""
    if torch.is_grad_enabled() and hidden.is_floating_point() and not hidden.requires_grad:
        hidden.requires_grad_()  # a leaf (nothing upstream records): costs one (B, T, H) gradient
    return hidden


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of token t+1 given tokens <= t; labels -100 are ignored."""
    # Shift the labels, not the logits (as HF does): slicing (B, T, V) logits would copy them.
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]  # (B, T): position t predicts token t+1
    logits = logits.float()  # a no-op in fp32
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=-100)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the positions whose label is not -100 (BERT's MLM loss)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy for (B, C) logits and (B,) class labels; MSE when C == 1 (regression), as HF."""
    if logits.size(-1) == 1:
        return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
    return F.cross_entropy(logits.float(), labels.reshape(-1))



def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position ids (B, T) that restart at 0 where the document id changes (a packed row's documents;
    padding, id 0, counts as a segment of its own). One document per row: 0 .. T-1, as HF's default."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)  # first token of each segment
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


def attention_inputs(doc_ids: torch.Tensor) -> tuple:
    """(attention_mask, position_ids) for a HF forward from the (B, T) int tensor dstk's batches carry:
    0 = padding, 1..k = the k-th document packed in the row (a 0/1 padding mask is the one-document case).

    Rows with one document each: the padding mask and 0 .. T-1 positions, exactly what HF builds itself.
    Packed rows: no padding mask and positions restarting per document, HF's packed-sequence format
    (masking_utils.find_packed_sequence_indices): attention never crosses a document (or padding) boundary
    and rotary/learned positions count from each document's start. Call the HF model with use_cache=False:
    with a cache (the default outside training) HF ignores the packed format."""
    if int(doc_ids.max()) <= 1:
        position_ids = torch.arange(doc_ids.shape[1], device=doc_ids.device).unsqueeze(0)
        return doc_ids, position_ids
    return None, document_positions(doc_ids)
