"""Expert parallelism in the planner (issue 41 step 5): an ep layout holds E / ep of each MoE block's experts, its
all-to-alls send tokens x k x h x 2 (dispatch, combine) x 2 (backward) activation bytes per MoE block, `dstk plan`
proposes ep for Qwen3-30B-A3B's shape on 8 GPUs and never for a dense model or with tp / sp, and the emitted
config passes `dstk validate --model`."""

import json

import pytest

from toolkit.cli import main
from toolkit.plan.arch import load_arch
from toolkit.plan.layouts.estimate import Layout, ep_comm_bytes
from toolkit.plan.cost.layers import layer_costs
from toolkit.plan.layouts.planner import PlanRequest, candidate_layouts, make_plan, model_of
from toolkit.plan.memory.rank import expert_states, model_state_bytes

# Qwen3-30B-A3B's published config.json (the shape the planner reads)
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}


def prepared(req: PlanRequest) -> tuple:
    arch = load_arch(req.model)
    seq = req.seq_len or min(2048, arch.max_positions)
    return arch, seq, layer_costs(arch, seq, 1, req.precision)


def qwen_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return str(tmp_path)


def test_expert_weights_and_grads_are_one_ep_th_states_partitioned_over_dp_over_ep():
    dense, experts = 1_000_000, 8_000_000
    one = expert_states(dense + experts, experts, 8, 1, 1, precision="bf16")
    four = expert_states(dense + experts, experts, 8, 4, 1, precision="bf16")
    assert one == model_state_bytes(dense + experts, 8, 1, precision="bf16")  # ep 1 is today's count
    # bf16 weights: the rank holds the dense part and experts / 4
    assert one.params - four.params == experts * 3 // 4 * 2
    # ZeRO-1's full gradients (plus its partition): experts / 4 of them, partitioned over dp / ep = 2
    assert four.grads == (dense + dense // 8 + experts // 4 + experts // 4 // 2) * 2
    # masters and Adam states: experts / 4 over 2 ranks = experts / 8, as at ep 1
    assert four.master == one.master and four.optimizer == one.optimizer
    zero0 = [expert_states(experts, experts, 8, ep, 0, precision="fp32") for ep in (1, 4)]
    assert zero0[0].peak == 4 * zero0[1].peak  # without ZeRO every expert state is / ep


def test_all_to_all_bytes_are_tokens_k_hidden_two_directions_two_passes(tmp_path):
    req = PlanRequest(model=qwen_dir(tmp_path), gbs=64, gpu="h100", seq_len=1024)
    arch, seq, costs = prepared(req)
    model = model_of(costs, arch, seq, req)
    lay = Layout(pp=1, dp=8, zero=1, mbs=2, gas=4, ep=4)
    per_layer = 1024 * 8 * 2048 * 2 * 2  # tokens x k x h x bf16 bytes x (dispatch, combine)
    expected = 48 * per_layer * 2 * 3 / 4 * 2 * 4  # 48 MoE blocks, x 2 backward, (ep-1)/ep leaves, mbs x gas
    assert ep_comm_bytes(model, [0, len(costs)], [0], lay) == expected
    ckpt = Layout(pp=1, dp=8, zero=1, mbs=2, gas=4, checkpointing=True, ep=4)
    assert ep_comm_bytes(model, [0, len(costs)], [0], ckpt) == expected * 3 / 2  # the recomputed forward
    assert sum(model.experts) == 48 * 128 * 3 * 2048 * 768


def test_plan_proposes_ep_for_qwen3_30b_a3b_on_8_gpus(tmp_path):
    result = make_plan(PlanRequest(model=qwen_dir(tmp_path), gbs=8, gpu="h100"))
    best = result.best[0]
    assert best.layout.ep > 1 and f"ep={best.layout.ep}" in best.layout.describe()
    same = [e for e in result.fitting if e.layout == Layout(**{**vars(best.layout), "ep": 1})]
    # the experts' weights are / ep: less memory than the same layout without ep
    assert not same or same[0].memory > best.memory
    builtin = make_plan(PlanRequest(model="qwen3-30b-a3b", gbs=8, gpu="h100"))
    assert builtin.best[0].layout == best.layout


def test_ep_never_for_dense_models_tp_sp_dualpipev_or_zero0(tmp_path):
    req = PlanRequest(model="llama-3.2-1b", gbs=16, gpu="h100")
    arch, _, costs = prepared(req)
    assert {lay.ep for _, lay in candidate_layouts(req, arch, costs, (1, 2))} == {1}
    req = PlanRequest(model=qwen_dir(tmp_path), gbs=16, gpu="h100")
    arch, _, costs = prepared(req)
    layouts = [lay for _, lay in candidate_layouts(req, arch, costs, (1, 2))]
    with_ep = [lay for lay in layouts if lay.ep > 1]
    assert with_ep and all(lay.tp == lay.sp == 1 and lay.schedule == "1f1b" and lay.zero >= 1 for lay in with_ep)
    assert all(lay.dp % lay.ep == 0 and 128 % lay.ep == 0 for lay in with_ep)
    assert any(lay.sp > 1 for lay in layouts) and any(lay.pp > 1 and lay.ep > 1 for lay in layouts)
    lora = PlanRequest(model=qwen_dir(tmp_path), gbs=16, gpu="h100", lora=8)
    assert {lay.ep for _, lay in candidate_layouts(lora, arch, costs)} == {1}


def run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out + out.err


def test_emitted_config_has_the_preset_and_validates(tmp_path, capsys):
    model = qwen_dir(tmp_path)
    out = tmp_path / "ds.json"
    code, text = run(capsys, "plan", "--model", model, "--gpus", "8", "--gpu", "h100", "--gbs", "8",
                     "--emit-config", str(out))
    assert code == 0, text
    cfg = json.loads(out.read_text())
    assert cfg["expert_parallel"]["enabled"] is True and cfg["expert_parallel"]["preset_model"] == "qwen3_moe"
    assert cfg["expert_parallel"]["autoep_size"] > 1 and f"ep={cfg['expert_parallel']['autoep_size']}" in text
    code, text = run(capsys, "validate", str(out), "--world-size", "8", "--model", model)
    assert code == 0, text
    assert load_arch(model).experts % cfg["expert_parallel"]["autoep_size"] == 0
