"""Packing with document masking (issue 13): several documents in one row compute what each document
computes alone (fp32, 1e-5): logits at every document's positions and the token-weighted loss, through
the pipeline wrappers (a real one-stage PipelineModule) and through the HF model at pp = 1 (HF's
packed-sequence format from models.spec.attention_inputs). The 2-stage case is in
tests/distributed/test_pipeline_models.py."""

import pytest
import torch

import models
from models.spec import attention_inputs, document_positions
from toolkit.train.parity import TOLERANCE, ensure_world_of_one, packed_batch, packed_vs_alone, small_model

CASES = {"llama": {}, "gpt2": {}, "qwen2": {}, "gpt_neox": {},
         "mistral": {"sliding_window": 4},  # a window shorter than a document: windows restart per document too
         "gemma2": {"sliding_window": 4, "final_logit_softcapping": 5.0}}


def test_positions_restart_per_document_and_padding():
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    assert document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0]]
    mask, positions = attention_inputs(doc_ids)
    assert mask is None  # packed: HF builds the document-blocked mask from the positions
    mask, positions = attention_inputs(torch.tensor([[1, 1, 0], [1, 1, 1]]))  # one document per row
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]] and positions.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("model_type", CASES)
def test_packed_rows_compute_each_document_alone(ds_world1, model_type):
    hf = small_model(model_type, attn_implementation="eager", **CASES[model_type])
    spec = models.pipeline_layers(hf)
    ensure_world_of_one()
    module = models.build_pipeline_module(spec, num_stages=1)
    inputs, labels, docs = packed_batch(hf.config)
    with torch.no_grad():
        logits = module(inputs)
        logit_diff, loss_diff = packed_vs_alone(logits, spec.loss_fn(logits, labels), hf, docs)
        assert logit_diff <= TOLERANCE and loss_diff <= TOLERANCE, (logit_diff, loss_diff)
        # pp = 1 trains the HF model itself on the same batch (toolkit.train.loop); with a cache (use_cache,
        # the default in eval) HF ignores the packed format and lets documents attend to each other
        mask, positions = attention_inputs(inputs[1])
        out = hf(input_ids=inputs[0], attention_mask=mask, position_ids=positions, labels=labels, use_cache=False)
        logit_diff, loss_diff = packed_vs_alone(out.logits, out.loss, hf, docs)
        assert logit_diff <= TOLERANCE and loss_diff <= TOLERANCE, (logit_diff, loss_diff)


def test_without_document_masking_the_documents_would_differ(ds_world1):
    """The check above can fail: the same packed ids with one document per row (cross-document attention)."""
    hf = small_model("llama", attn_implementation="eager")
    (ids, doc_ids), labels, docs = packed_batch(hf.config)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=(doc_ids > 0).long()).logits
    assert packed_vs_alone(logits, 0.0, hf, docs)[0] > 1e-2
