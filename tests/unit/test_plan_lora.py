"""`dstk plan --lora R` and `dstk partition --lora R`: a frozen base in the planner (issue 12).

The adapter counts are checked against what peft creates through dstk's trainer path
(models.lora.adapters.apply on a tiny HF model); the bytes against the full fine-tune arithmetic; the
CLI for its output and its refusals (its fast start: tests/commands/test_start_up.py). Real engines:
tests/distributed/test_memory_accuracy.py.
"""

import json
import re

import pytest

from tests.unit.test_plan import run  # `dstk plan ARGS` -> (exit code, stdout, stderr)
from toolkit.errors import ConfigError
from toolkit.plan.arch import arch_from_config, build_hf_model, layer_params, load_arch
from toolkit.plan.cost.layers import layer_costs
from toolkit.plan.layouts.estimate import Layout
from toolkit.plan.lora import lora_params, param_counts
from toolkit.plan.layouts.planner import PlanRequest, estimate_layout, make_plan

LLAMA_7B_R16 = 39_976_960  # peft's print_trainable_parameters for Llama-2-7b, r=16 on all 7 projections

# Fused projections: GPT-NeoX's query_key_value, Phi-3's qkv_proj and gate_up_proj.
TINY_CONFIGS = {
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 160, "vocab_size": 256, "max_position_embeddings": 128},
    "phi3": {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 256,
             "max_position_embeddings": 128, "pad_token_id": 0},
}


def _arch(name):
    return arch_from_config(TINY_CONFIGS[name], name) if name in TINY_CONFIGS else load_arch(name)


def _peft_counts(arch, r: int) -> dict:
    """Trainable parameters peft creates through the trainer's path, by block index ("head" outside blocks)."""
    from peft import LoraConfig, get_peft_model

    from models.lora.adapters import LoraSettings, apply, resolve_targets

    model, settings = build_hf_model(arch, device="cpu"), LoraSettings(r=r)
    if arch.is_encoder:  # the planner's BERT is the MLM model (no causal-LM wrapper): the trainer's targets
        model = get_peft_model(model, LoraConfig(r=r, target_modules=resolve_targets(model, settings)[0]))
    else:
        model = apply(model, settings, task="causal-lm")
    counts = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            index = re.search(r"\.(\d+)\.", name)
            key = int(index.group(1)) if index else "head"
            counts[key] = counts.get(key, 0) + p.numel()
    return counts


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-bert", "gpt_neox", "phi3"])
def test_adapter_counts_per_layer_equal_what_peft_creates(name):
    arch, r = _arch(name), 4
    ours = dict(zip([n for n, _, _ in layer_params(arch)], lora_params(arch, r)))
    theirs = _peft_counts(arch, r)
    assert {i: ours[f"block.{i}"] for i in range(arch.layers)} == {k: v for k, v in theirs.items() if k != "head"}
    assert ours.get("head", 0) == theirs.get("head", 0)  # BERT: peft's "dense" also adapts the MLM transform
    assert sum(v for k, v in ours.items() if not k.startswith("block.")) == theirs.get("head", 0)
    params, trainable = param_counts(arch, r)
    assert trainable == sum(theirs.values()) and params == arch.num_params() + trainable


def test_llama_7b_adapters_match_the_published_count():
    params, trainable = param_counts(load_arch("llama-2-7b"), 16)
    assert trainable == LLAMA_7B_R16 and params == 6_738_415_616 + LLAMA_7B_R16


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_lora_model_states_are_far_below_full_fine_tuning_for_a_7b_llama(zero):
    """Same layout, same model: only the adapters carry gradients, masters and Adam states."""
    layout = Layout(pp=1, dp=8, zero=zero, mbs=1, gas=4)
    req = dict(model="llama-2-7b", gbs=32, gpus_per_node=8, gpu="a100-80gb", seq_len=2048)
    full = estimate_layout(PlanRequest(**req), layout).states
    lora = estimate_layout(PlanRequest(**req, lora=16), layout).states
    assert lora.grads + lora.master + lora.optimizer < 0.01 * (full.grads + full.master + full.optimizer)
    # the frozen base: its bf16 weights (ZeRO-3 partitions them), plus the adapters
    assert lora.params == (6_738_415_616 + LLAMA_7B_R16) * 2 // (8 if zero == 3 else 1)
    if zero < 3:
        assert lora.peak < 0.5 * full.peak
    if zero == 0:  # bf16 without ZeRO: 20 bytes per trained parameter, 2 per frozen one
        assert full.peak == 20 * 6_738_415_616 and lora.peak == 2 * 6_738_415_616 + 20 * LLAMA_7B_R16


def test_lora_fits_a_7b_llama_where_full_fine_tuning_does_not():
    req = dict(model="llama-2-7b", gbs=8, gpus_per_node=1, gpu="l4", seq_len=512, offload=False)
    assert make_plan(PlanRequest(**req)).fitting == []
    lora = make_plan(PlanRequest(**req, lora=16))
    assert lora.fitting and lora.best[0].memory <= lora.best[0].capacity
    assert (lora.params, lora.trainable) == (6_738_415_616 + LLAMA_7B_R16, LLAMA_7B_R16)


def test_lora_reduces_gradient_traffic_and_backward_compute_not_activations():
    layout = Layout(pp=1, dp=8, zero=1, mbs=1, gas=4)
    req = dict(model="llama-2-7b", gbs=32, gpus_per_node=8, gpu="a100-80gb", seq_len=2048)
    full, lora = estimate_layout(PlanRequest(**req), layout), estimate_layout(PlanRequest(**req, lora=16), layout)
    assert lora.activations == full.activations  # the frozen base still backpropagates through them
    assert lora.dp_comm_bytes == int(2 * 7 / 8 * LLAMA_7B_R16 * 2)  # reduce-scatter + all-gather of bf16 adapters
    assert 0.6 < lora.times["compute"] / full.times["compute"] < 0.8  # no weight gradients for the base


def test_layer_costs_with_lora():
    arch = load_arch("llama-2-7b")
    full, lora = layer_costs(arch, 128), layer_costs(arch, 128, lora=16)
    embed, block, head = 0, 1, len(full) - 1
    assert [c.act_bytes for c in lora] == [c.act_bytes for c in full]
    assert lora[embed].flops == 0 and lora[embed].trainable == 0  # a frozen lookup: no backward at all
    assert lora[block].fwd_flops > full[block].fwd_flops  # the adapters' matmuls
    assert 0.66 < lora[block].flops / full[block].flops < 0.7  # short sequence: matmuls dominate, 2/3 of 3x
    assert lora[head].flops < 0.7 * full[head].flops and lora[head].trainable == 0
    assert lora[block].trainable == LLAMA_7B_R16 // 32 and lora[block].params == full[block].params + LLAMA_7B_R16 // 32
    # bf16: frozen weights 2 bytes; adapters 2 + 2 (grad) + 8 (Adam) + 4 (fp32 master)
    assert lora[block].state_bytes == 2 * lora[block].params + 14 * lora[block].trainable


def test_the_memory_split_moves_when_weights_no_longer_dominate():
    """With a frozen base the activations 1F1B keeps in flight (most on stage 0) weigh more than the states:
    the `memory` method moves blocks off the first stage."""
    from toolkit.plan.cost.partition import partition_layers

    arch = load_arch("llama-2-7b")
    full = partition_layers(layer_costs(arch, 2048), 4, "memory")
    lora = partition_layers(layer_costs(arch, 2048, lora=16), 4, "memory")
    assert lora[1] < full[1]


@pytest.mark.parametrize("r", [0, -2, True, 2.0])
def test_a_bad_rank_is_refused(r):
    with pytest.raises(ConfigError, match="--lora must be a positive integer"):
        lora_params(load_arch("gpt2"), r)
    with pytest.raises(ConfigError, match="--lora must be a positive integer"):
        make_plan(PlanRequest(model="gpt2", gbs=8, gpu="l4", gpus_per_node=2, lora=r))


def test_plan_cli_says_lora_r_and_trainable_count(capsys):
    args = ["--model", "llama-2-7b", "--gpu", "a100-80gb", "--gpus-per-node", "8", "--gbs", "64", "--seq-len", "2048"]
    code, out, err = run(capsys, *args, "--lora", "16", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["lora_r"] == 16 and report["trainable_params"] == LLAMA_7B_R16
    assert report["params"] == 6_738_415_616 + LLAMA_7B_R16
    states = report["best"][0]["model_states"]
    assert states["optimizer"] < 2 * 8 * LLAMA_7B_R16  # Adam's states: the adapters' (at most unpartitioned)
    code, full_out, _ = run(capsys, *args, "--json")
    assert json.loads(full_out)["lora_r"] is None and json.loads(full_out)["trainable_params"] == 6_738_415_616
    code, text, _ = run(capsys, *args, "--lora", "16")
    assert code == 0 and f"LoRA r=16 on every block linear: {LLAMA_7B_R16:,} trainable" in text


@pytest.mark.parametrize("value", ["0", "-1"])
def test_plan_cli_refuses_a_bad_rank_in_one_line(capsys, value):
    code, out, err = run(capsys, "--model", "gpt2", "--gpu", "l4", "--gbs", "8", "--lora", value)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.strip() == f"error: --lora must be a positive integer (the LoRA rank r), got {value}"
