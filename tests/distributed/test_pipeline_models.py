"""Two real pipeline stages (2 processes, deepspeed launcher, gloo) give the HF model's loss, logits
and gradients for llama, qwen2 (tied), gemma2, gpt2 (tied), BERT MLM (tied) and classification, mixtral and
qwen3_moe with their router aux loss in the loss (the sums cross the stage boundary),
with and without padding; packed rows of several documents give each document's own logits and loss;
a sharded saved model loads per stage. Part of the session's one launch of scripts/engines.py
(tests/distributed/conftest.py; this part ~30 s on 2 cores)."""

import json

import pytest

from toolkit.train.parity import TOLERANCE


@pytest.fixture(scope="module")
def results(engine_runs):
    """rank -> case -> differences, from scripts/pipeline_models_parity.py's part of the launch."""
    return [json.loads((engine_runs / "parity" / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.distributed
def test_two_stages_match_hf(results):
    cases = [c for c in results[0] if c != "dir" and not c.startswith("packed:")]
    assert len(cases) == 16 and set(cases) == {c for c in results[1] if c != "dir" and not c.startswith("packed:")}
    assert results[0]["gpt2:causal-lm:pad=True"]["parts"] == [0, 1, 5]  # the given boundaries, not DeepSpeed's
    for case in cases:
        first, last = results[0][case], results[1][case]
        assert (first["stage"], last["stage"]) == (0, 1) and first["parts"] == last["parts"]
        for rank in (first, last):
            assert rank["grads"] > 0 and rank["loss"] <= TOLERANCE and rank["grad"] <= TOLERANCE, (case, rank)
        assert last["logits"] <= TOLERANCE, case
        # a tied module's other parameters (wpe, MLM transform) are trained on one stage only
        for name in set(first["extras"]) | set(last["extras"]):
            owners = [r["extras"][name] for r in (first, last) if name in r["extras"]]
            assert min(owners) <= TOLERANCE, (case, name)


@pytest.mark.distributed
def test_packed_documents_through_two_stages_compute_each_document_alone(results):
    packed = [c for c in results[1] if c.startswith("packed:")]
    assert sorted(packed) == ["packed:gemma2", "packed:gpt2", "packed:llama", "packed:qwen2"]
    for case in packed:
        assert results[0][case]["stage"] == 0 and results[1][case]["stage"] == 1
        last = results[1][case]
        assert last["logits"] <= TOLERANCE and last["loss"] <= TOLERANCE, (case, last)


@pytest.mark.distributed
def test_sharded_directory_loads_per_stage(results):
    first, last = results[0]["dir"], results[1]["dir"]
    assert first["loss"] <= TOLERANCE and last["logits"] <= TOLERANCE
    assert first["params_held"] + last["params_held"] == first["params_total"]  # each stage: its own half
    assert 0 < first["params_held"] < first["params_total"]
