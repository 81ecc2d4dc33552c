"""Mixture-of-experts models in the planner (issues 16, 40): parameters count every expert and equal the HF
model's on the meta device, block by block; FLOPs count the top-k experts a token runs, checked against
torch's FlopCounterMode on small real HF MoE models; DeepSeek-V2/V3's latent attention (MLA), shared experts
and first dense blocks likewise; `dstk plan` and `dstk partition` read MoE configs and refuse MoE families
they do not model."""

import json
import re
from dataclasses import replace

import pytest

from toolkit.errors import ConfigError
from toolkit.plan.arch import arch_from_config, layer_params, load_arch, to_hf_config
from toolkit.plan.cost.layers import layer_costs
from toolkit.plan.layouts.estimate import Layout
from toolkit.plan.lora import lora_params
from toolkit.plan.moe import moe_act_bytes, moe_flops
from toolkit.plan.layouts.planner import PlanRequest, estimate_layout

MIXTRAL_8X7B = 46_702_792_704  # HF's Mixtral-8x7B-v0.1 (and the meta-device model of its config)
MIXTRAL_8X7B_CONFIG = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                       "vocab_size": 32000, "max_position_embeddings": 32768, "num_local_experts": 8,
                       "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False}

BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128, intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY = {  # every MoE feature modelled: fused experts, shared expert and gate, dense blocks, q/k norms, biases
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3]),
    "qwen2_moe_dense": dict(model_type="qwen2_moe", num_experts=0),  # HF builds every block dense
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=32, attention_bias=True, mlp_only_layers=[0]),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, attention_bias=True),
    "qwen3": dict(model_type="qwen3", head_dim=32, attention_bias=True),  # dense, the same q/k norms as qwen3_moe
    # MLA with both latents, shared experts (2 x 32 wide), the first block dense; HF needs kv heads = heads
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_group=1, topk_group=1,
                        num_key_value_heads=4, attention_bias=True),
    # V2-Lite's plain q_proj (q_lora_rank null), mlp_bias on the dense MLP and the shared experts
    "deepseek_v2": dict(model_type="deepseek_v2", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, num_key_value_heads=4,
                        mlp_bias=True),
}


def _config(name, **overrides):
    return {**BASE, **TINY[name], **overrides}


def _hf_model(cfg: dict, device="meta", experts="eager", attention="eager"):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation, config._experts_implementation = attention, experts
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config)


def _hf_layer_params(model) -> dict:
    """Parameters per pipeline layer name, as layer_params names them."""
    out = {}
    for name, p in model.named_parameters():
        block = re.search(r"\.layers\.(\d+)\.", name)
        key = f"block.{block.group(1)}" if block else "head" if "lm_head" in name else \
            "norm" if name.endswith("model.norm.weight") else "embed"
        out[key] = out.get(key, 0) + p.numel()
    return out


@pytest.mark.parametrize("name", sorted(TINY))
def test_params_per_layer_equal_the_hf_model_on_meta(name, tmp_path):
    cfg = _config(name)
    arch = arch_from_config(cfg, name)
    model = _hf_model(cfg)
    assert {n: held for n, held, _ in layer_params(arch)} == _hf_layer_params(model)
    assert arch.num_params() == sum(p.numel() for p in model.parameters())
    to_hf_config(arch).save_pretrained(tmp_path)  # config.json as transformers writes it reads the same
    assert load_arch(str(tmp_path)).num_params() == arch.num_params()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_mla_projections_are_the_hf_attention_linears(name):
    """mla_linears (FLOPs, LoRA's adapters) are the nn.Linear modules of HF's attention, in order."""
    from torch import nn

    from toolkit.plan.mla import mla_linears

    arch = arch_from_config(_config(name), name)
    attention = _hf_model(_config(name)).model.layers[0].self_attn
    linears = [(m.in_features, m.out_features) for m in attention.children() if isinstance(m, nn.Linear)]
    assert linears == mla_linears(arch)


def test_dense_blocks_and_shared_expert_are_read():
    qwen2 = arch_from_config(_config("qwen2_moe"), "q")
    # decoder_sparse_step 2: blocks 1 and 3 are sparse, but mlp_only_layers makes 3 dense
    assert qwen2.dense_blocks == (0, 2, 3) and [qwen2.moe_block(i) for i in range(4)] == [False, True, False, False]
    assert (qwen2.experts, qwen2.experts_per_token, qwen2.expert_intermediate, qwen2.shared_intermediate,
            qwen2.shared_gate) == (4, 2, 32, 48, True)
    assert not arch_from_config(_config("qwen2_moe_dense"), "q").is_moe
    deepseek = arch_from_config(_config("deepseek_v3"), "d")
    # first_k_dense_replace 1; two shared experts of 32 run as one MLP of 64 without a gate
    assert deepseek.dense_blocks == (0,) and (deepseek.shared_intermediate, deepseek.shared_gate) == (64, False)
    # MLA: a query/key head is nope + rope wide, a value head its own width; every head has its key and value
    assert (deepseek.head_dim, deepseek.v_head_dim, deepseek.kv_heads, deepseek.q_lora_rank) == (48, 24, 4, 48)
    assert arch_from_config(_config("deepseek_v2"), "d").q_lora_rank == 0  # null: one q_proj


def test_deepseek_reads_transformers_own_config_dict():
    """What from_pretrained's config.to_dict() holds (dstk train reads that): DeepseekV2Config adds head_dim =
    qk_rope_head_dim and qk_head_dim, which MLA must not take for its heads."""
    import transformers

    for name in ("deepseek_v2", "deepseek_v3"):
        cfg = transformers.AutoConfig.for_model(**_config(name)).to_dict()
        assert arch_from_config(cfg, name).num_params() == arch_from_config(_config(name), name).num_params()


def test_mixtral_8x7b_has_its_real_size():
    import torch
    import transformers

    arch = load_arch("mixtral-8x7b")
    from_dir = arch_from_config(MIXTRAL_8X7B_CONFIG, "Mixtral-8x7B-v0.1")
    assert arch.num_params() == from_dir.num_params() == MIXTRAL_8X7B
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(to_hf_config(from_dir))
    assert sum(p.numel() for p in model.parameters()) == MIXTRAL_8X7B
    assert arch.active_params() == MIXTRAL_8X7B - 32 * 6 * 3 * 4096 * 14336  # 2 of 8 experts: about 12.9B


def test_forward_flops_count_the_top_k_experts_not_all():
    arch = arch_from_config(_config("mixtral"), "m")
    n, h, ie = 128, arch.hidden, arch.expert_intermediate

    def block(a):
        return layer_costs(a, 128)[1]

    one, base, wide = block(replace(arch, experts_per_token=1)), block(arch), block(replace(arch, experts=8))
    # twice the experts at the same k: only the router (h x E) grows, by 2*n*h*4 FLOPs forward
    assert moe_flops(replace(arch, experts=8), n) - moe_flops(arch, n) == 2 * n * h * 4
    assert wide.fwd_flops - base.fwd_flops == pytest.approx(2 * n * h * 4, rel=0.3)  # + softmax over 4 more
    assert wide.params - base.params == 4 * (h + 3 * h * ie)  # ... while memory holds every expert
    assert wide.state_bytes == 16 * wide.params
    # k 2 -> 1 halves the experts' part: 3 matmuls of 2*n*h*I_e per routed row
    assert moe_flops(arch, n) - moe_flops(replace(arch, experts_per_token=1), n) == 3 * 2 * n * h * ie
    assert base.fwd_flops - one.fwd_flops == pytest.approx(3 * 2 * n * h * ie, rel=0.05)
    assert base.act_bytes > one.act_bytes


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2"])
def test_flops_and_activations_match_a_real_hf_moe_model(name):
    """FlopCounterMode counts the matmuls that run: HF's eager expert loop runs each token's k experts; MLA's
    five projections and its scores over nope + rope, P@V over v."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    b, t = 2, 64
    cfg = _config(name, hidden_size=256, intermediate_size=384, num_hidden_layers=2, vocab_size=512, head_dim=64,
                  moe_intermediate_size=128, shared_expert_intermediate_size=256, mlp_only_layers=[])
    key = next(k for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in cfg)
    cfg.update({key: 8})
    if name.startswith("deepseek"):  # the first block dense, the second MoE; MLA sets its own head widths
        cfg.update(first_k_dense_replace=1)
        del cfg["head_dim"]
    arch = arch_from_config(cfg, name)
    torch.manual_seed(0)
    model = _hf_model(cfg, device="cpu")
    saved, current = {}, [None]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(x):  # bytes autograd keeps for backward inside each block, and its MLP (parameters excluded)
        if current[0] is not None and x.untyped_storage().data_ptr() not in params:
            for key in current:
                saved.setdefault(key, {})[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None))
        layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: current.append(f"{i}.mlp"))
        layer.mlp.register_forward_hook(lambda mod, args, out: current.remove(current[-1]))  # returns None
    ids = torch.randint(0, cfg["vocab_size"], (b, t))
    with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(input_ids=ids, labels=ids).loss.backward()
    counts = {k.split(".", 1)[1]: sum(v.values()) for k, v in counter.get_flop_counts().items() if "." in k}
    costs = layer_costs(arch, t, b, precision="fp32", attention="eager")
    n = b * t
    for i in range(arch.layers):
        cost = costs[1 + i]
        assert cost.flops == pytest.approx(counts[f"model.layers.{i}"], rel=0.02), cost.name
        assert cost.act_bytes == pytest.approx(sum(saved[i].values()), rel=0.10), cost.name
        if arch.moe_block(i):  # exactly: forward + backward (2 x forward) of the router, k experts per token
            # and the shared expert. (FlopCounterMode files backward FLOPs under whichever submodule's backward
            # is running, e.g. the router's under the experts too: the MoE block's own total is the one to compare.)
            assert counts[f"model.layers.{i}.mlp"] == 3 * moe_flops(arch, n)
            # the MLP's own tensors (less its input, the norm's output, counted with the block's norms), as
            # moe_act_bytes counts them: per routed row also the scaled output index_add_ keeps
            mlp_bytes = sum(saved[f"{i}.mlp"].values()) - 4 * n * arch.hidden
            assert moe_act_bytes(arch, n, 4) == pytest.approx(mlp_bytes, rel=0.01), cost.name


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_lora_adapts_attention_the_shared_expert_and_the_experts_as_peft_does(name):
    """transformers' experts are 3-D parameters, adapted through peft's target_parameters (the router is not
    adapted); qwen3_moe's dense block's gate/up/down_proj are names peft takes for its experts' (frozen, and
    the experts' gate_up_proj at rank 2 r)."""
    from models.lora.adapters import LoraSettings, apply

    cfg = _config(name)
    arch, r = arch_from_config(cfg, name), 4
    model = apply(_hf_model(cfg, device="cpu"), LoraSettings(r=r), task="causal-lm")
    theirs = {}
    for pname, p in model.named_parameters():
        if p.requires_grad:
            block = int(re.search(r"\.layers\.(\d+)\.", pname).group(1))
            theirs[f"block.{block}"] = theirs.get(f"block.{block}", 0) + p.numel()
    ours = {n: c for (n, _, _), c in zip(layer_params(arch), lora_params(arch, r)) if c}
    assert ours == theirs


def test_model_states_hold_every_expert_and_compute_follows_the_active_ones():
    req = PlanRequest(model="mixtral-8x7b", gbs=64, gpus_per_node=8, nodes=2, gpu="h100-sxm", seq_len=4096)
    est = estimate_layout(req, Layout(pp=1, dp=16, zero=3, mbs=1, gas=4))
    assert est.states.params == -(-MIXTRAL_8X7B // 16) * 2  # bf16 shard of all 46.7B parameters
    arch, t = load_arch("mixtral-8x7b"), 4096
    flops = sum(c.flops for c in layer_costs(arch, t))
    # about 6 FLOPs per active parameter per token (+ attention), far below 6 per parameter
    assert 6 * arch.active_params() * t < flops < 1.1 * 6 * arch.active_params() * t
    assert flops < 0.3 * 6 * arch.num_params() * t


DBRX = {**_config("qwen3"), "model_type": "dbrx", "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2}}


@pytest.mark.parametrize("cfg, words", [
    (DBRX, re.escape("'dbrx' is a mixture-of-experts model (4 routed experts)")),
    ({**_config("mixtral"), "model_type": "gpt_oss"}, "attention sinks"),
    ({**_config("qwen3"), "model_type": "granitemoe", "num_local_experts": 4}, "counted exactly: deepseek_v2, "
                                                                               "deepseek_v3, mixtral, olmoe"),
    (_config("mixtral", num_experts_per_tok=5), r"experts_per_token \(num_experts_per_tok\) must be in \[1, "
                                                r"experts\(4\)\], got 5"),
    ({k: v for k, v in _config("deepseek_v2").items() if k != "num_experts_per_tok"},  # V2 has no default
     r"experts_per_token \(num_experts_per_tok\) must be in \[1, experts\(4\)\], got 0"),
    (_config("deepseek_v3", kv_lora_rank=0), "kv_lora_rank must be a positive integer"),
])
def test_moe_families_not_modelled_are_refused(cfg, words):
    with pytest.raises(ConfigError, match=words):
        arch_from_config(cfg, "m")


def test_plan_and_partition_refuse_gpt_oss_cleanly(tmp_path, capsys):
    from toolkit.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**_config("mixtral"), "model_type": "gpt_oss"}))
    for argv in (["plan", "--model", str(tmp_path), "--gpu", "h100-sxm", "--gbs", "8"],
                 ["partition", str(tmp_path), "--pp", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and "Traceback" not in err
        assert "attention sinks" in err and "dstk refuses it" in err
