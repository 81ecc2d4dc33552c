"""The causal LM loss with the head inside, in tiles of tokens (models.tiled.loss): the same loss and gradients as
HF's own forward, for heads with a softcap, a logit scale or a divisor, tied or not; with labels masked, with sp's
shifted labels and token counts; with the loss scaled after it (1 / gradient accumulation, a loss scale), which
DeepSpeed's TiledFusedLogitsLoss leaves out of the head's gradients; and at a pipeline's last stage. Tiles are made
7 tokens long here, so every loss spans several. Every model type the generic pipeline takes: the heavy case."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import models.tiled.loss as tl
from models.generic import LMHead, LogitTransform
from models.spec import causal_lm_loss
from toolkit.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from arch_sweep_config import build_tiny  # noqa: E402


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tl, "TILE_BYTES", 1)
    monkeypatch.setattr(tl, "MIN_TILE", 7)


def tiny(kind: str):
    model = build_tiny(kind)
    model = (model[0] if isinstance(model, tuple) else model).float().train()
    tiled = copy.deepcopy(model)
    tl.patch_causal_lm(tiled, LogitTransform(model.config))
    return model, tiled


def grads(model, scale: float = 1.0) -> dict:
    return {n: p.grad / scale for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict, b: dict, rel: float = 1e-5):
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=rel, atol=rel * a[name].abs().max().item()), name


def batch(config, rows: int = 2, tokens: int = 24):
    torch.manual_seed(1)
    ids = torch.randint(0, config.get_text_config().vocab_size, (rows, tokens))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt: no loss there
    return ids, labels


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2", "cohere", "granite", "qwen2", "mixtral"])
def test_the_tiled_loss_is_hfs_loss_and_gradients_even_when_scaled_afterwards(kind):
    model, tiled = tiny(kind)
    ids, labels = batch(model.config)
    ours = tiled(input_ids=ids, labels=labels, use_cache=False)
    theirs = model(input_ids=ids, labels=labels, use_cache=False)
    assert ours.logits is None and ours.loss.item() == pytest.approx(theirs.loss.item(), rel=1e-6)
    theirs.loss.backward()
    (ours.loss * 0.25).backward()  # as the engine's backward divides by gradient_accumulation_steps
    assert_same(grads(model), grads(tiled, 0.25))


def test_sps_shifted_labels_and_token_count_give_hfs_loss():
    model, tiled = tiny("llama")
    ids, labels = batch(model.config)
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    count = torch.tensor(int((shift != -100).sum()) + 3)  # the micro-batch's targets over every sp rank's slice
    kwargs = {"input_ids": ids, "shift_labels": shift, "labels": shift, "num_items_in_batch": count, "use_cache": False}
    ours, theirs = tiled(**kwargs).loss, model(**kwargs).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    ours.backward(), theirs.backward()
    assert_same(grads(model), grads(tiled))


def test_without_labels_the_models_own_forward_runs():
    model, tiled = tiny("llama")
    ids, _ = batch(model.config)
    assert torch.equal(tiled(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits)


def test_the_last_stages_tiled_loss_is_the_pipelines_loss():
    model, _ = tiny("gemma2")
    head = LMHead(type("Source", (), {"module": lambda self, name, allow_missing: model.lm_head})(), "lm_head",
                  LogitTransform(model.config))
    hidden = torch.randn(2, 24, model.config.hidden_size, requires_grad=True)
    _, labels = batch(model.config)
    plain = causal_lm_loss(head(hidden), labels)
    plain.backward()
    expected = grads(model) | {"hidden": hidden.grad.clone()}
    model.zero_grad(), hidden.grad.zero_()
    ours = tl.TiledPipelineLoss(head, causal_lm_loss, model.config.vocab_size)(hidden, labels)
    assert ours.item() == pytest.approx(plain.item(), rel=1e-6)
    ours.backward()
    assert_same(expected, grads(model) | {"hidden": hidden.grad})


def test_auto_turns_on_at_half_a_gib_of_logits_and_on_is_refused_where_it_cannot_be():
    on, why = tl.choose("auto", 4096, 32000)  # 4096 x 32000 x 4 bytes: 500 MiB
    assert not on and "500.0 MiB" in why and "below 0.5 GiB" in why
    assert tl.choose("auto", 4096, 32768)[0] and not tl.choose("off", 10**6, 32768)[0]
    assert tl.choose("on", 16, 320)[0]
    assert tl.choose("auto", 10**6, 32768, blocker="no head") == (False, "no head")
    with pytest.raises(ConfigError, match="--tiled-loss on: no head; use --tiled-loss auto or off"):
        tl.choose("on", 16, 320, blocker="no head")


def exact_types() -> list:
    """The model types bench/arch_sweep.py finds exact as pipelines (its last results)."""
    import json

    rows = json.loads((Path(__file__).resolve().parents[2] / "bench/results/arch_sweep.json").read_text())["rows"]
    kinds = [r["type"] for r in rows if r["outcome"] == "exact"]
    assert len(kinds) > 80
    return kinds


def assert_trains_alike(model, tiled, kind: str) -> None:
    """The same loss (1e-5) and gradients (1e-4) from `model` and its `tiled` copy on one batch."""
    ids, labels = batch(model.config)
    torch.manual_seed(5)  # random routing in training (phimoe, dbrx): the same draws for both
    theirs = model(input_ids=ids, labels=labels, use_cache=False).loss
    torch.manual_seed(5)
    ours = tiled(input_ids=ids, labels=labels, use_cache=False).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5), kind
    theirs.backward(), ours.backward()
    assert_same(grads(model), grads(tiled), rel=1e-4)


@pytest.mark.heavy
def test_every_model_type_the_pipelines_take_gives_hfs_loss_tiled():
    for kind in exact_types():
        assert_trains_alike(*tiny(kind), kind)


def zero3_steps(model, steps: int = 3) -> list:
    """(loss, global gradient norm) of `steps` steps of `model` under a real ZeRO-3 engine (every weight partitioned)
    on one batch."""
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids, labels = batch(model.config)
    out = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=labels, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        out.append((loss.item(), float(engine.get_global_grad_norm())))
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # the head's own weight; gpt2's is the embedding's (tied)
def test_zero3_tiles_train_as_the_whole_logits_do(kind, ds_world1):
    """ZeRO-3 partitions the head's weight between uses: each tile's recompute gathers it through the module, and
    ZeRO's bucket takes its gradient once, after the last tile (a tied one's after the embedding's use too)."""
    model, tiled = tiny(kind)
    assert tiled.get_input_embeddings().weight is tiled.get_output_embeddings().weight or kind != "gpt2"
    want, got = zero3_steps(model), zero3_steps(tiled)
    for (loss, norm), (loss_t, norm_t) in zip(want, got):
        assert loss_t == pytest.approx(loss, rel=1e-5) and norm_t == pytest.approx(norm, rel=1e-5), (want, got)
    assert want[0] != want[-1]  # it trained
