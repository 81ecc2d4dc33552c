"""The decoder blocks' MLP through DeepSpeed's TiledMLP (models.tiled.mlp): the same loss and gradients as HF's own
forward for Llama, Qwen2, Gemma2 (gated) and GPT-2 (Conv1D, no gate) MLPs, with rows of a micro-batch cut into
shards of 7 tokens (so every MLP call spans several and the shards cross rows); with LoRA on the MLP's linears
(peft's layers run inside each shard, and get their gradients with the base frozen); with dropout (each shard's
recompute draws the masks its forward drew); MoE blocks left whole; the choice auto / on / off."""

import copy
import sys
from pathlib import Path

import pytest
import torch

import models.tiled.mlp as tm
from tests.unit.test_tiled_loss import assert_same, assert_trains_alike, batch, exact_types, grads
from toolkit.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from arch_sweep_config import build_tiny  # noqa: E402


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    monkeypatch.setattr(tm, "shard_tokens", lambda hidden: 7)


def tiny(kind: str):
    model = build_tiny(kind)
    model = (model[0] if isinstance(model, tuple) else model).float().train()
    tiled = copy.deepcopy(model)
    patched = tm.patch_mlps(tiled, model.config.hidden_size)
    assert patched == model.config.num_hidden_layers
    return model, tiled


def step(model, ids, labels):
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gpt2"])
def test_the_tiled_mlp_gives_hfs_loss_and_gradients(kind, monkeypatch):
    model, tiled = tiny(kind)
    calls = []
    apply = tm.ShardForward.__call__
    monkeypatch.setattr(tm.ShardForward, "__call__", lambda self, m, x: calls.append(x.shape[0]) or apply(self, m, x))
    ids, labels = batch(model.config)
    assert step(tiled, ids, labels) == pytest.approx(step(model, ids, labels), rel=1e-6)
    assert_same(grads(model), grads(tiled))
    # 48 rows in shards of 7 (torch.chunk: 6 of 7 and one of 6), forward and backward, in every block
    assert len(calls) == 7 * 2 * model.config.num_hidden_layers and set(calls) == {6, 7}


def test_lora_on_the_mlp_alone_trains_its_adapters_in_shards():
    from peft import LoraConfig, get_peft_model

    model, _ = tiny("llama")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    plain = get_peft_model(model, lora)
    tiled = copy.deepcopy(plain)
    assert tm.patch_mlps(tiled, model.config.hidden_size) == model.config.num_hidden_layers
    ids, labels = batch(model.config)
    assert step(tiled, ids, labels) == pytest.approx(step(plain, ids, labels), rel=1e-6)
    got, want = grads(tiled), grads(plain)
    assert want and all("lora_" in n for n in want)  # the base is frozen: only the adapters' gradients
    assert_same(want, got)


def test_each_shards_recompute_draws_the_dropout_its_forward_drew(monkeypatch):
    model = build_tiny("gpt2")
    model = (model[0] if isinstance(model, tuple) else model).float().train()
    mlp = model.transformer.h[0].mlp
    mlp.dropout.p = 0.5
    x = torch.randn(2, 12, model.config.hidden_size, requires_grad=True)
    torch.manual_seed(3)
    pieces = [mlp(piece) for piece in x.reshape(-1, x.shape[-1]).chunk(4)]  # what 4 shards draw, whole graphs
    (torch.cat(pieces) ** 2).sum().backward()
    want = {"x": x.grad.clone()} | {n: p.grad.clone() for n, p in mlp.named_parameters()}
    x.grad, _ = None, mlp.zero_grad(set_to_none=True)
    tm.patch_mlps(model, 6)
    monkeypatch.setattr(tm, "shard_tokens", lambda hidden: 6)  # 24 rows: 4 shards
    torch.manual_seed(3)
    out = mlp(x)
    (out ** 2).sum().backward()
    assert torch.allclose(out.reshape(-1, out.shape[-1]), torch.cat(pieces).detach(), atol=1e-6)
    assert_same(want, {"x": x.grad} | {n: p.grad for n, p in mlp.named_parameters()})


def test_without_grad_the_mlp_runs_whole_and_moe_blocks_are_left_alone(monkeypatch):
    model, tiled = tiny("llama")
    monkeypatch.setattr(tm.ShardForward, "__call__", lambda *a: pytest.fail("tiled without grad"))
    ids, _ = batch(model.config)
    with torch.no_grad():
        assert torch.equal(tiled(input_ids=ids).logits, model(input_ids=ids).logits)
    moe = build_tiny("mixtral")
    moe = moe[0] if isinstance(moe, tuple) else moe
    assert tm.dense_mlps(moe) == [] and tm.patch_mlps(moe, 64) == 0
    on, why, _ = tm.decide("auto", moe, moe.config, 10**6, 2)
    assert not on and "no dense MLP" in why


def test_auto_turns_on_at_a_gib_of_intermediates_and_on_is_refused_where_it_cannot_be():
    # Llama-3-8B in bf16: 4 x 14336 x 2 bytes a token; 9362 tokens are just under 1 GiB, 9363 over
    assert not tm.choose("auto", 9362, 4096, 14336, 2)[0] and tm.choose("auto", 9363, 4096, 14336, 2)[0]
    on, why = tm.choose("auto", 1024, 64, 176, 4)
    assert not on and "2.8 MiB" in why and "below 1 GiB" in why
    assert tm.choose("on", 16, 64, 176, 4)[0] and not tm.choose("off", 10**6, 4096, 14336, 2)[0]
    # 4 GiB of intermediates in rows of 4096 tokens, no longer than the hidden size: a throughput setting, left whole
    on, why = tm.choose("auto", 40000, 4096, 14336, 2, sequence=4096)
    assert not on and "a row's 4096 tokens fit one shard of 4096" in why
    assert tm.choose("auto", 40000, 4096, 14336, 2, sequence=4097)[0]
    assert tm.choose("auto", 10**6, 4096, 14336, 2, blocker="no mlp") == (False, "no mlp")
    with pytest.raises(ConfigError, match="--tiled-mlp on: no mlp; use --tiled-mlp auto or off"):
        tm.choose("on", 16, 64, 176, 4, blocker="no mlp")


def test_shards_are_as_many_as_torch_chunk_cuts(monkeypatch):
    for tokens in range(1, 200):
        for per in (7, 64):
            monkeypatch.setattr(tm, "shard_tokens", lambda hidden, per=per: per)
            count = tm.shards(tokens, 64)
            assert len(torch.arange(tokens).chunk(count)) == count


@pytest.mark.heavy
def test_every_model_type_the_pipelines_take_gives_hfs_loss_with_tiled_mlps():
    tiled_kinds = 0
    for kind in exact_types():
        model = build_tiny(kind)
        model = (model[0] if isinstance(model, tuple) else model).float().train()
        tiled = copy.deepcopy(model)
        tiled_kinds += tm.patch_mlps(tiled, 64) > 0
        assert_trains_alike(model, tiled, kind)
    assert tiled_kinds > 60
