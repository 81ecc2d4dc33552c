"""Real MoE checkpoints' config.json (issue 40, the planner): Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 and
DeepSeek-V2-Lite count what transformers builds from them on the meta device, and the published totals within
1%; the built-ins of the same names agree; `dstk plan` shows every stage's total and active parameters.

The hub is unreachable here: the dicts are the checkpoints' config.json (model cards, transformers' config
defaults), with the keys the planner and transformers read."""

import json

import pytest

from toolkit.plan.arch import arch_from_config, load_arch
from toolkit.plan.layouts.planner import PlanRequest, make_plan
from tests.unit.test_plan_moe import MIXTRAL_8X7B_CONFIG

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
               "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1, "vocab_size": 129280,
               "max_position_embeddings": 163840, "attention_bias": False, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy", "n_group": 1,
                    "topk_group": 1, "vocab_size": 102400, "max_position_embeddings": 163840,
                    "tie_word_embeddings": False}

# (config.json, built-in, published total, published active, whether the published active counts the input
# embedding). DeepSeek's "activated" figures leave the embedding out (V3: 36.6B "including 0.9B for the output
# head", 37.5B with the embedding); Qwen's 3.3B and Mistral's 12.9B are with it.
PUBLISHED = {
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, "qwen3-30b-a3b", 30.5e9, 3.3e9, True),
    "Mixtral-8x7B": (MIXTRAL_8X7B_CONFIG, "mixtral-8x7b", 46.7e9, 12.9e9, True),
    "DeepSeek-V3": (DEEPSEEK_V3, "deepseek-v3", 671e9, 36.6e9, False),
    "DeepSeek-V2-Lite": (DEEPSEEK_V2_LITE, None, 15.7e9, 2.4e9, False),
}


def _meta_count(cfg: dict) -> int:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_hub_configs_count_what_transformers_builds_and_the_published_sizes(name):
    cfg, builtin, total, active, with_embedding = PUBLISHED[name]
    arch = arch_from_config(cfg, name)
    assert arch.num_params() == _meta_count(cfg)  # exactly: DeepSeek-V3 671,026,404,352 (no MTP block)
    assert arch.num_params() == pytest.approx(total, rel=0.01)
    embedding = 0 if with_embedding else arch.vocab * arch.hidden
    # the published active counts have two digits (3.3B for 3.35B, 2.4B for 2.45B): 2.5%
    assert arch.active_params() - embedding == pytest.approx(active, rel=0.025)
    if builtin:
        assert (load_arch(builtin).num_params(), load_arch(builtin).active_params()) == \
            (arch.num_params(), arch.active_params())


def test_deepseek_v3_counts_its_parts():
    """Where DeepSeek-V3's 671B sit: 3 dense blocks, 58 MoE blocks of 256 routed + 1 shared expert, MLA."""
    arch = load_arch("deepseek-v3")
    h, ie = 7168, 2048
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    dense = 2 * h + mla + 3 * h * 18432
    moe = 2 * h + mla + 256 * h + 256 * 3 * h * ie + 3 * h * ie  # router, routed experts, shared expert
    assert arch.num_params() == 2 * 129280 * h + h + 3 * dense + 58 * moe
    assert arch.active_params() == arch.num_params() - 58 * (256 - 8) * 3 * h * ie


@pytest.fixture(scope="module")
def qwen_plan():
    return make_plan(PlanRequest(model="qwen3-30b-a3b", gpu="h100-sxm", gpus_per_node=8, gbs=64, seq_len=4096,
                                 top=50))


def test_plan_shows_each_stages_total_and_active_parameters(qwen_plan, tmp_path, capsys):
    arch = load_arch("qwen3-30b-a3b")
    piped = [e for e in qwen_plan.fitting if e.layout.pp > 1 and e.layout.schedule == "1f1b"]
    assert piped, "a pipeline layout fits"
    for e in piped:
        # untied: the stages hold every parameter once, and k of E routed experts of each run per token
        assert sum(s.params for s in e.stages) == arch.num_params()
        assert sum(s.active_params for s in e.stages) == arch.active_params()
        # a stage holding MoE blocks runs 8 of their 128 experts; the embedding's and the head's run whole
        assert [s.active_params < s.params for s in e.stages] == [s.first < arch.layers + 1 and s.last > 1
                                                                  for s in e.stages]
        assert [s.first for s in e.stages] + [e.stages[-1].last] == e.parts
    from toolkit.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "qwen3-30b-a3b", "--gpu", "h100-sxm", "--gbs", "64", "--seq-len", "4096", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["active_params"] == arch.active_params()
    for best in report["best"]:
        assert sum(s["active_params"] for s in best["stages"]) == arch.active_params()
        assert len(best["stages"]) == len(best["parts"]) - 1


def test_dense_stages_are_all_active(capsys):
    result = make_plan(PlanRequest(model="llama-3-8b", gpu="a100-40gb", gpus_per_node=8, gbs=64, seq_len=2048))
    stages = [s for e in result.fitting for s in e.stages]
    assert stages and all(s.active_params == s.params for s in stages)
    from toolkit.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3-8b", "--gpu", "a100-40gb", "--gbs", "64", "--seq-len", "2048"])
    out = capsys.readouterr().out
    assert "active per token" not in out and " active)" not in out
    assert "parameters (one tp=" in out or "stages [parameters, memory/GPU]" in out or "parameters 8.03B" in out
