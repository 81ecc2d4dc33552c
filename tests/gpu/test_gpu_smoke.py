"""GPU tier: skipped without CUDA (CI has none). On a GPU, a dstk bf16 config trains a wrapped model."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_zero1_config_trains_a_small_llama_on_gpu(ds_world1):
    import deepspeed
    from transformers import LlamaConfig

    from toolkit.config.generate import build_config
    from toolkit.config.options import GenerateOptions
    from models.weights.loading import random_model

    cfg = build_config(GenerateOptions(world_size=1, mbs=4, gas=1, zero=1, precision="bf16", lr=1e-3))
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=512, attn_implementation="sdpa")
    model = random_model(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.randint(0, 512, (4, 64), device=engine.device)
    losses = []
    for _ in range(10):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    engine.destroy()
