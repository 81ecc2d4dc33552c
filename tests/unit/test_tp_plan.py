"""`dstk plan` with tensor parallelism: one AutoTP rank's memory, FLOPs and traffic against hand
arithmetic, and the layouts it tries (toolkit.plan.tp, planner, estimate), alone (pp = 1) and inside
pipeline stages (3D: only the blocks are sharded, the embedding, final norm and head stay whole)."""

import json

import pytest

from toolkit.cli import main
from toolkit.plan.arch import load_arch
from toolkit.plan.cost.layers import layer_costs, mask_bytes
from toolkit.plan.layouts.estimate import Layout
from toolkit.plan.layouts.planner import PlanRequest, candidate_layouts, model_of, estimate_layout, make_plan
from toolkit.plan.tp import shard_layers, tp_candidates, tp_comm_bytes

H, I, V, L, T = 4096, 11008, 32000, 32, 4096  # llama-2-7b: 32 heads = 32 kv heads, no biases, untied
BLOCK = 4 * H * H + 3 * H * I + 2 * H  # q, k, v, o; gate, up, down; two RMSNorms
BLOCK_TP2 = 2 * H + (4 * H * H + 3 * H * I) // 2  # norms replicated, every linear halved
RANK_TP2 = V * H + L * BLOCK_TP2 + H + V * H // 2  # untied embedding replicated, lm_head column-parallel


def test_llama_2_7b_tp2_halves_weights_but_norms_and_the_untied_embedding():
    arch = load_arch("llama-2-7b")
    costs = layer_costs(arch, T, 1, "bf16")
    assert costs[1].params == BLOCK
    rank = shard_layers(arch, costs, T, "bf16", 2)
    assert rank["params"] == [V * H] + [BLOCK_TP2] * L + [H, V * H // 2]
    assert rank["tied"] == [0] * (L + 3)
    # activations of a block, per sequence: the norms' 6h per token (RMSNorm in, fp32 normalised, out,
    # twice) stay whole, q/k/v/o/rotary (6h) and the MLP's 4 I per token halve
    replicated, sharded = 2 * T * 6 * H, 2 * T * (6 * H + 4 * I)
    assert rank["act"][1] == replicated + sharded // 2
    assert rank["flops"][1] == costs[1].flops / 2 and rank["flops"][0] == costs[0].flops


def test_tied_embedding_is_vocab_sharded():
    arch = load_arch("llama-3.2-1b")  # tied: transformers plans embed_tokens embedding_rowwise
    costs = layer_costs(arch, 2048, 1, "bf16")
    rank = shard_layers(arch, costs, 2048, "bf16", 2)
    assert rank["params"][0] == rank["params"][-1] == rank["tied"][-1] == arch.vocab * arch.hidden // 2


def test_tp_comm_is_four_all_reduces_per_block_plus_the_head():
    arch = load_arch("llama-2-7b")
    hidden = T * H * 2  # one (1, seq, h) bf16 activation
    all_reduce = 2 * (1 / 2) * hidden  # ring all-reduce at tp 2 sends 2 (tp-1)/tp of the bytes
    head = (1 / 2) * T * V * 2 + all_reduce  # gather the logits, all-reduce the input gradient
    assert tp_comm_bytes(arch, T, 1, "bf16", 2) == L * 4 * all_reduce + head
    assert tp_comm_bytes(arch, T, 1, "bf16", 2, checkpointing=True) == L * 6 * all_reduce + head
    assert tp_comm_bytes(arch, T, 1, "bf16", 1) == 0


def test_estimate_of_a_tp_layout_matches_hand_arithmetic():
    req = PlanRequest(model="llama-2-7b", gbs=64, gpus_per_node=8, gpu="a100-80gb", seq_len=T)
    e = estimate_layout(req, Layout(pp=1, dp=4, zero=1, mbs=2, gas=8, tp=2))
    assert e.states.params == RANK_TP2 * 2  # bf16 weights of one tp rank
    assert e.states.master == -(-RANK_TP2 // 4) * 4  # ZeRO-1: fp32 masters of a 1/dp partition
    assert e.dp_comm_bytes == int(2 * (3 / 4) * RANK_TP2 * 2)  # all-reduce of the rank's gradients over dp = 4
    assert e.tp_comm_bytes == int(tp_comm_bytes(load_arch("llama-2-7b"), T, 1, "bf16", 2) * 2 * 8)
    assert e.times["tp_comm"] == pytest.approx(e.tp_comm_bytes / 300e9)  # a100 nvlink, 300 GB/s
    whole = estimate_layout(req, Layout(pp=1, dp=8, zero=1, mbs=2, gas=4))
    assert whole.times["tp_comm"] == 0 and whole.states.params == (V * H * 2 + L * BLOCK + H) * 2


def test_tp_candidates_stay_inside_a_node():
    arch = load_arch("llama-2-7b")
    assert tp_candidates(arch, 8) == [1, 2, 4, 8]
    assert tp_candidates(arch, 6) == [1, 2]  # 3 and 6 do not divide 32 heads
    assert tp_candidates(load_arch("gpt2"), 8) == [1]  # no AutoTP plan
    assert tp_candidates(arch, 8, lora=16) == [1] and tp_candidates(load_arch("mixtral-8x7b"), 8) == [1]
    req = PlanRequest(model="llama-2-7b", gbs=64, gpus_per_node=4, nodes=2, gpu="a100-80gb", seq_len=1024)
    costs = layer_costs(arch, 1024, 1, "bf16")
    layouts = [lay for _, lay in candidate_layouts(req, arch, costs, tp_candidates(arch, 4))]
    assert {lay.tp for lay in layouts} == {1, 2, 4}
    assert {(lay.pp, lay.tp) for lay in layouts if lay.tp > 1} == {(1, 2), (1, 4), (2, 2), (2, 4), (4, 2)}
    for lay in layouts:
        assert lay.pp * lay.dp * lay.tp * lay.sp == 8 and lay.dp * lay.mbs * lay.gas == 64
        if lay.tp > 1:  # tp groups are tp consecutive ranks: inside one node of 4
            assert 4 % lay.tp == 0 and (lay.zero < 2 or lay.pp == 1)


def test_plan_ranks_tp_layouts_and_json_shows_tp(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--gpus-per-node", "8", "--gbs", "64",
              "--seq-len", "4096", "--top", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert exit_info.value.code == 0 and out["tp_candidates"] == [1, 2, 4, 8]
    tps = [b["layout"]["tp"] for b in out["best"]]
    assert all(b["tp"] == b["layout"]["tp"] for b in out["best"]) and max(tps) > 1 and min(tps) == 1
    tp2 = next(b for b in out["best"] if b["layout"]["tp"] == 2)
    assert tp2["tp_comm_bytes"] > 0 and tp2["times_s"]["tp_comm"] > 0 and "tp=2" in tp2["describe"]


def test_plan_emits_a_tp_config_that_validates(capsys, tmp_path):
    out = tmp_path / "ds.json"
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--gpus-per-node", "8", "--gbs", "64",
              "--seq-len", "4096", "--emit-config", str(out)])
    cfg = json.loads(out.read_text())
    assert cfg["tensor_parallel"]["autotp_size"] > 1 and "train_batch_size" not in cfg
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(out), "--world-size", "8", "--model", "llama-2-7b"])
    assert exit_info.value.code == 0, capsys.readouterr()


def test_models_without_autotp_plan_only_tp_1():
    result = make_plan(PlanRequest(model="gpt2", gbs=16, gpus_per_node=4, gpu="a100-80gb", seq_len=512))
    assert result.tp_candidates == (1,) and all(e.layout.tp == 1 for e in result.fitting)


# llama-2-7b on 4 nodes of 2 L4-class GPUs with 26 GiB: tp = 2 alone (pp = 1) fits only with ZeRO-3 without
# offload, tp inside pipeline stages does (on a real L4, 22.5 GiB, nothing fits once the loss's peak, 1.5 GiB
# at seq 4096, and the CUDA context and NCCL buffers are counted)
SMALL_NODES = PlanRequest(model="llama-2-7b", gbs=32, gpus_per_node=2, nodes=4, gpu="l4", gpu_mem=26 * 2**30,
                          seq_len=T, offload=False, top=8)


def test_3d_layouts_are_considered_and_fit_where_tp_alone_needs_zero3():
    arch = load_arch("llama-2-7b")
    layouts = [lay for _, lay in candidate_layouts(SMALL_NODES, arch, layer_costs(arch, T, 1, "bf16"), [1, 2])]
    assert {(lay.pp, lay.tp) for lay in layouts if lay.pp > 1 and lay.tp > 1} == {(2, 2), (4, 2)}
    result = make_plan(SMALL_NODES)
    assert result.considered == len(layouts) and result.tp_candidates == (1, 2)
    assert {e.layout.zero for e in result.fitting if e.layout.pp == 1 and e.layout.tp > 1} == {3}
    three_d = [e for e in result.fitting if e.layout.pp > 1 and e.layout.tp > 1]
    assert three_d and any(e.layout.tp > 1 for e in result.best)
    assert all(e.layout.pp * e.layout.dp * e.layout.tp == 8 for e in three_d)


def test_pipeline_tp_shards_the_blocks_but_not_the_embedding_norm_and_head():
    arch, req = load_arch("llama-2-7b"), PlanRequest(model="llama-2-7b", gbs=32, gpu="a100-80gb", seq_len=T)
    costs = layer_costs(arch, T, 1, "bf16")
    whole, alone, piped = (model_of(costs, arch, T, req, tp, pipe) for tp, pipe in ((1, False), (2, False), (2, True)))
    assert piped.params == [V * H] + [BLOCK_TP2] * L + [H, V * H]  # the lm_head whole, not V * H / 2
    assert alone.params[-1] == V * H // 2 and whole.params[1] == BLOCK
    ends = [0, L + 1, L + 2]  # embedding, final norm, head: the unsharded figures
    whole_piped = model_of(costs, arch, T, req, 1, True)  # in a pipeline the head also holds its logits (bf16)
    for key in ("params", "flops", "fwd_flops", "act", "peak"):
        assert [getattr(piped, key)[i] for i in ends] == [getattr(whole_piped, key)[i] for i in ends]
    assert whole_piped.act[-1] - whole.act[-1] == 2 * T * V and piped.peak[-1] == alone.peak[-1] == 12 * T * V
    assert piped.params[1] == pytest.approx(BLOCK / 2, rel=1e-3) and piped.flops[1] == whole.flops[1] / 2
    # the attention mask: one per stage (at pp = 1 for the model: HF's, made additive once), whole on each tp rank
    mask = mask_bytes(T, 1, "bf16")
    assert alone.flops[-1] == whole.flops[-1] / 2 and piped.act[1] == alone.act[1] < whole.act[1]
    assert piped.stage_act == alone.stage_act == whole.stage_act == mask
    # no collectives of the head in a pipeline: four all-reduces of (seq, h) per block only
    assert piped.tp_comm == L * 4 * 2 * (1 / 2) * T * H * 2 < alone.tp_comm


def test_pipeline_tp_keeps_a_tied_embedding_whole():
    arch = load_arch("llama-3.2-1b")  # at pp = 1 vocab-parallel (V / tp per rank); in 3D whole
    costs = layer_costs(arch, 2048, 1, "bf16")
    rank = shard_layers(arch, costs, 2048, "bf16", 2, pipeline=True)
    assert rank["params"][0] == rank["params"][-1] == rank["tied"][-1] == arch.vocab * arch.hidden
    assert shard_layers(arch, costs, 2048, "bf16", 2)["params"][0] == arch.vocab * arch.hidden // 2


def test_estimate_of_a_3d_layout_counts_its_stage_only():
    req = PlanRequest(model="llama-2-7b", gbs=32, gpus_per_node=2, nodes=4, gpu="a100-40gb", seq_len=T)
    e = estimate_layout(req, Layout(pp=2, dp=2, zero=1, mbs=1, gas=16, tp=2))
    lo, hi = e.parts[e.stage], e.parts[e.stage + 1]
    blocks = len([i for i in range(lo, hi) if 1 <= i <= L])
    whole_ends = (V * H if lo == 0 else 0) + (H + V * H if hi == L + 3 else 0)  # embedding; norm and lm_head
    assert e.states.params == (whole_ends + blocks * BLOCK_TP2) * 2  # bf16 weights of one rank of the stage
    most = max(len([i for i in range(a, b) if 1 <= i <= L]) for a, b in zip(e.parts, e.parts[1:]))
    assert 0 < most < L and e.tp_comm_bytes == int(most * 4 * 2 * (1 / 2) * T * H * 2 * 16)  # its blocks, gas 16


def test_3d_layouts_are_zero_0_or_1():
    arch = load_arch("llama-2-7b")
    req = PlanRequest(model="llama-2-7b", gbs=64, gpus_per_node=8, nodes=2, gpu="a100-80gb", seq_len=1024)
    layouts = [lay for _, lay in candidate_layouts(req, arch, layer_costs(arch, 1024, 1, "bf16"), tp_candidates(arch, 8))]
    zeros = {(lay.pp > 1, lay.tp > 1): set() for lay in layouts}
    for lay in layouts:
        zeros[lay.pp > 1, lay.tp > 1].add(lay.zero)
    assert zeros == {(False, False): {0, 1, 2, 3}, (False, True): {0, 1, 2, 3}, (True, False): {0, 1},
                     (True, True): {0, 1}}  # DeepSpeed's PipelineEngine refuses ZeRO 2 and 3
