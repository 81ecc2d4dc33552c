"""The path real users take, on CPU: a pretrained bf16 checkpoint trains in fp32 masters, inputs follow
the engine's device, the attention kernel is chosen once, weight decay skips biases/norms/embeddings,
activation checkpointing at pp = 1 is honoured, an encoder is not trained as a causal LM."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.configs import SHORT_EVAL
from toolkit.errors import ConfigError
from models.weights import loading
from toolkit.train import hf

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A small Llama saved in bf16 (as almost every published checkpoint is), with the byte tokenizer."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("bf16_llama")
    tok = hf.byte_tokenizer()
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    loading.random_model(config, seed=0).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_bf16_checkpoint_trains_fp32_masters_under_an_fp32_config(ds_world1, bf16_llama, tmp_path):
    """3 steps at lr 1e-5: updates of ~1e-5 are below bf16's resolution for weights of ~1e-2, so a
    model left in bf16 keeps almost every weight; fp32 masters move nearly all of them."""
    from safetensors.torch import load_file

    from toolkit.train.runner import TrainArgs, run

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                               "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {
                                   "lr": 1e-5, "weight_decay": 0.0, "torch_adam": True}}}))
    run(TrainArgs(model=str(bf16_llama), data=str(CORPUS), config=str(cfg), out=str(tmp_path / "run"), seq_len=32,
                  steps=3, progress=False, eval_fraction=SHORT_EVAL))
    before = load_file(bf16_llama / "model.safetensors")
    after = load_file(tmp_path / "run" / "hf" / "model.safetensors")
    moved = {k: (after[k] != before[k].float()).float().mean().item() for k in before
             if before[k].ndim == 2 and "embed_tokens" not in k}  # embedding rows move only for the bytes seen
    assert all(after[k].dtype == torch.float32 for k in after)
    assert min(moved.values()) > 0.9, moved


def test_each_pipeline_stage_loads_its_tensors_in_fp32(bf16_llama):
    import models

    spec = models.pipeline_layers(str(bf16_llama))
    for layer in spec.layers:
        built = layer.build() if hasattr(layer, "build") else layer
        assert {p.dtype for p in built.parameters()} <= {torch.float32}


def test_a_model_from_a_bf16_config_is_fp32(bf16_llama):
    import models
    from transformers import AutoConfig

    spec = models.pipeline_layers(AutoConfig.from_pretrained(bf16_llama))
    built = [layer.build() if hasattr(layer, "build") else layer for layer in spec.layers]
    assert {p.dtype for layer in built for p in layer.parameters()} == {torch.float32}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_attention_kernel_is_chosen_once(bf16_llama, attention):
    tok = hf.byte_tokenizer()
    for source in ("tiny-llama", str(bf16_llama)):
        config = hf.load_config(source, tok, "causal-lm", attention=attention)
        model = loading.build_model(source, config, "causal-lm", 0)
        assert model.config._attn_implementation == attention
    assert hf.load_config("tiny-gpt2", tok, "causal-lm")._attn_implementation == "sdpa"  # the default


def test_flash_attention_without_cuda_is_refused_naming_the_way_out():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="--attention flash_attention_2 needs a CUDA GPU .* use --attention sdpa"):
        hf.check_attention("flash_attention_2")


def test_pp1_batches_follow_the_engine_device():
    """DeepSpeedEngine.forward does not move inputs. A stand-in engine on the meta device plays the GPU
    (none exists here): the batch must arrive on the engine's device, not on the CPU."""
    from toolkit.train.loop import forward_loss

    class Engine:
        device = torch.device("meta")
        module = loading.build_model("tiny-llama", hf.load_config("tiny-llama", hf.byte_tokenizer(), "causal-lm"),
                                "causal-lm", 0)  # what the engine wraps: its config names the attention

        def __call__(self, **inputs):
            self.seen = {k: v.device for k, v in inputs.items() if isinstance(v, torch.Tensor)}  # not use_cache
            return type("Out", (), {"loss": torch.zeros((), device="meta")})()

    engine = Engine()
    forward_loss(engine, ((torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)),
                      torch.ones(2, 4, dtype=torch.long)))
    assert set(engine.seen.values()) == {torch.device("meta")}


def test_weight_decay_skips_biases_norms_and_embeddings():
    from toolkit.train.engine import param_groups

    tok = hf.byte_tokenizer()
    model = loading.build_model("tiny-gpt2", hf.load_config("tiny-gpt2", tok, "causal-lm"), "causal-lm", 0)
    decay, plain = param_groups(model, {"optimizer": {"params": {"weight_decay": 0.1}}})
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} == {n for n, p in model.named_parameters()
                                                        if n.endswith(("attn.c_attn.weight", "attn.c_proj.weight",
                                                                       "mlp.c_fc.weight", "mlp.c_proj.weight"))}
    assert any(".wte." in names[id(p)] for p in plain["params"]) and any("ln_f" in names[id(p)] for p in plain["params"])


def test_pp1_activation_checkpointing_in_the_config_is_honoured(ds_world1):
    """Same loss and gradients, fewer bytes saved for backward (counted with saved_tensors_hooks)."""
    from toolkit.distributed.topology import Topology
    from toolkit.train.engine import make_model
    from toolkit.train.runner import TrainArgs

    tok = hf.byte_tokenizer()
    config = hf.load_config("tiny-llama", tok, "causal-lm")
    args = TrainArgs(model="tiny-llama", data=str(CORPUS), config="-", seq_len=64)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    batch = {"train_micro_batch_size_per_gpu": 2}
    for cfg in (batch, {**batch, "activation_checkpointing": {"partition_activations": False}}):
        model, _ = make_model(args, config, Topology(1), cfg)
        model.train()
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), model.model.embed_tokens.weight.grad.clone(), sum(saved),
                        model.is_gradient_checkpointing))
    (plain_loss, plain_grad, plain_bytes, off), (ckpt_loss, ckpt_grad, ckpt_bytes, on) = results
    assert not off and on
    assert abs(plain_loss - ckpt_loss) < 1e-5 and torch.allclose(plain_grad, ckpt_grad, atol=1e-6)
    assert ckpt_bytes < 0.7 * plain_bytes, f"saved for backward: {ckpt_bytes} B with checkpointing, {plain_bytes} B without"


def test_a_model_read_from_a_folder_trains_in_training_mode(ds_world1, tmp_path):
    """from_pretrained returns a model in eval mode: trained so, it would drop no dropout and HF would checkpoint
    nothing (its layers checkpoint only in training mode) until the first evaluation switched it."""
    from toolkit.distributed.topology import Topology
    from toolkit.train.engine import make_model
    from toolkit.train.runner import TrainArgs

    tok = hf.byte_tokenizer()
    config = hf.load_config("tiny-llama", tok, "causal-lm")
    folder = tmp_path / "llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    args = TrainArgs(model=str(folder), data=str(CORPUS), config="-", seq_len=64)
    cfg = {"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {}}
    model, _ = make_model(args, hf.load_config(str(folder), tok, "causal-lm"), Topology(1), cfg)
    assert all(m.training for m in model.modules())
    assert model.is_gradient_checkpointing


def test_an_encoder_is_not_trained_as_a_causal_lm():
    with pytest.raises(ConfigError, match="bert is an encoder .* use --task classification"):
        hf.load_config("tiny-bert", hf.byte_tokenizer(), "causal-lm")


def test_zero3_builds_the_model_partitioned(ds_world1):
    """Under a ZeRO-3 config every parameter is a placeholder (no elements held) with its full size
    recorded for DeepSpeed; other stages build it whole. (A built-in is built whole first, then
    partitioned, for the same random weights at every stage; a directory loads inside zero.Init.)"""
    tok = hf.byte_tokenizer()
    config = hf.load_config("tiny-llama", tok, "causal-lm")
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    model = loading.build_model("tiny-llama", config, "causal-lm", 0, cfg)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 0 and all(hasattr(p, "ds_id") for p in params)
    assert sum(p.ds_numel for p in params) == sum(p.numel() for p in loading.build_model("tiny-llama", config, "causal-lm", 0).parameters())


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_bf16_training_exports_the_fp32_masters(ds_world1, tmp_path, zero):
    """Under bf16 the module holds bf16 weights and the optimizer fp32 masters: the export carries the
    masters (most values are not bf16-representable), or bf16 with --dtype bf16 (config.json says which)."""
    from safetensors.torch import load_file

    from toolkit.export.directory import export
    from toolkit.train.runner import TrainArgs, run

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                               "gradient_clipping": 0.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": zero},
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}))
    run(TrainArgs(model="tiny-llama", data=str(CORPUS), config=str(cfg), out=str(tmp_path / "run"), seq_len=32,
                  steps=2, progress=False, eval_fraction=SHORT_EVAL))
    weights = load_file(tmp_path / "run" / "hf" / "model.safetensors")
    w = weights["model.layers.0.mlp.down_proj.weight"]
    off_grid = (w.bfloat16().float() != w).float().mean().item()
    assert w.dtype == torch.float32 and off_grid > 0.5, f"{off_grid:.0%} of the weights are not bf16 values"
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["dtype"] == "float32"
    export(tmp_path / "run", tmp_path / "half", dtype="bf16")
    half = load_file(tmp_path / "half" / "model.safetensors")
    assert half["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_pipeline_stages_from_a_directory_run_the_chosen_kernel(bf16_llama, attention):
    import models

    spec = models.pipeline_layers(str(bf16_llama), attention=attention)
    block = spec.layers[1].build() if hasattr(spec.layers[1], "build") else spec.layers[1]
    kernels = {m.config._attn_implementation for m in block.modules() if hasattr(m, "config")}
    assert kernels == {attention}


def test_zero0_masters_from_fusedadams_flat_groups():
    """On CUDA, DeepSpeed's AdamW is FusedAdam under FP16_Optimizer, which saves one flat fp32 tensor per
    group ("fp32_groups_flat") instead of one per parameter. That format, written as DeepSpeed writes
    it (no GPU here to make one), is cut back into parameters by the recorded order."""
    from toolkit.errors import UnusableInput
    from toolkit.checkpoint.state import zero0_masters

    saved = {"module": {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.bfloat16)},
             "optimizer": {"fp32_groups_flat": [torch.arange(10.0)]}}
    masters = zero0_masters(saved, {"param_groups": [["w", "b"]]})
    assert masters["w"].tolist() == [0, 1, 2, 3, 4, 5] and masters["b"].tolist() == [6, 7, 8, 9]
    with pytest.raises(UnusableInput, match="do not match the parameter order"):
        zero0_masters({"module": saved["module"], "optimizer": {"fp32_groups": [[torch.ones(6)]]}},
                       {"param_groups": [["w", "b"]]})


@pytest.mark.parametrize("cfg, name", [({"fp16": {"enabled": True}}, "float16"), ({"bf16": {"enabled": True}}, "bfloat16"),
                                       ({"bfloat16": {"enabled": True}}, "bfloat16"), ({}, "float32")])
def test_qlora_computes_in_the_runs_precision(cfg, name):
    """QLoRA's bnb_4bit_compute_dtype (engine.make_model) is the run's: an fp16 config computed in fp32 before."""
    assert str(loading.param_dtype(cfg)).removeprefix("torch.") == name and hasattr(torch, name)


def test_the_planner_counts_bf16_optimizers_fp32_gradient_buffer(ds_world1):
    """generate-config's bf16 default (ZeRO-1, grad_accum_dtype fp32) on a real engine: the model-state bytes
    it holds after a backward (toolkit.train.report.footprint) against toolkit.plan.memory.rank's prediction."""
    import deepspeed

    from toolkit.plan.memory.rank import model_state_bytes
    from toolkit.train.report.footprint import held_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 256, dtype=torch.bfloat16)).float().pow(2).mean())
        held = held_bytes(engine)
        engine.step()
    engine.destroy()
    predicted = model_state_bytes(n, dp=1, zero=1, precision="bf16", fp32_grad_accum=True).peak
    assert abs(predicted - held) <= 0.05 * held, (predicted, held)
