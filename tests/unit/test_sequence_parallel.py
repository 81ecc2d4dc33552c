"""Ulysses sequence parallelism (sp) in the batch arithmetic, the rules, generate-config and validate."""

import pytest

from toolkit.config.options import GenerateOptions
from toolkit.config.generate import build_config
from toolkit.config.problems import ERROR
from toolkit.config.rules import check_rules
from toolkit.config.rules.sequence_parallel import ulysses_problems
from toolkit.distributed.topology import Topology, config_batch, sp_of
from toolkit.errors import ConfigError

SP2 = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
       "sequence_parallel_size": 2}


def errors(problems):
    return [p.message for p in problems if p.severity == ERROR]


def test_sp_groups_are_consecutive_ranks_as_deepspeed_builds_them():
    topo = Topology(8, sp=2)
    assert topo.dp == 4
    assert [topo.coords(r)[1] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # dp rank = rank // sp
    assert [topo.sp_rank(r) for r in range(8)] == [0, 1] * 4
    assert topo.rank(0, 3, 1) == 7
    assert topo.describe() == "pp(1) * dp(4) * sp(2) = world(8)"


def test_world_not_divisible_by_sp_names_the_fix():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by pp\(1\) \* sp\(4\) = 4"):
        Topology(6, sp=4)


def test_batch_counts_dp_as_world_over_sp():
    assert config_batch(SP2, Topology(4, sp=2).dp).describe() == "mbs(1) * gas(2) * dp(2) = gbs(4)"
    assert check_rules(SP2, world_size=4) == []
    [message] = errors(check_rules(SP2, world_size=8))
    assert "dp = world(8) / (pp(1) * sp(2)) = 4" in message


def test_sp_of_reads_the_key_and_refuses_nonsense():
    assert sp_of({}) == 1 and sp_of(SP2) == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        sp_of({"sequence_parallel_size": 0})


def test_sp_inside_pipeline_stages_counts_dp_as_world_over_pp_and_sp():
    cfg = dict(SP2, train_batch_size=4, pipeline={"stages": 2})
    assert errors(check_rules(cfg, world_size=8)) == []
    [message] = errors(check_rules(cfg, world_size=4))  # dp 1: gbs 2
    assert "dp = world(4) / (pp(2) * sp(2)) = 1" in message
    topo = Topology(8, pp=2, sp=2)
    assert [topo.coords(r) for r in range(8)] == [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    assert [topo.sp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_sp_with_autotp_is_refused():
    cfg = {k: v for k, v in SP2.items() if k != "train_batch_size"} | {"tensor_parallel": {"autotp_size": 2}}
    messages = errors(check_rules(cfg, world_size=8))
    assert any('"autotp_size" 2' in m and "AutoTP" in m and '"autotp_size": 1' in m for m in messages)


def test_world_not_divisible_by_sp_in_rules():
    [message] = errors(check_rules(SP2, world_size=3))
    assert 'world size 3 is not divisible by pp(1) * sp(2) = 2' in message and "one of 1, 3" in message


def test_sp_flag_must_agree_with_the_file():
    message = errors(check_rules(SP2, world_size=4, sp=4))[0]  # then the batch, counted with the file's sp
    assert '"sequence_parallel_size" is 2 in the file but --sp is 4' in message
    assert check_rules({k: v for k, v in SP2.items() if k != "sequence_parallel_size"}, world_size=4, sp=2) == []


def test_heads_what_ulysses_needs():
    assert ulysses_problems(4, 2, 2, 128) == []
    assert ulysses_problems(4, 2, 4) == []  # sp divisible by kv heads: each kv head replicated
    [heads] = ulysses_problems(4, 4, 8)
    assert "sp 8 does not divide num_attention_heads 4" in heads and "sp one of 2, 4" in heads
    [kv] = ulysses_problems(12, 8, 6)
    assert "num_key_value_heads 8" in kv and "sp one of 2, 4" in kv
    [seq] = ulysses_problems(4, 4, 2, 127)
    assert "seq-len 127 is not divisible by sp 2" in seq and "--seq-len 126 or 128" in seq


def test_generate_config_writes_sp_and_counts_dp():
    cfg = build_config(GenerateOptions(world_size=4, sp=2, mbs=1, gbs=4, cpu=True))
    assert cfg["sequence_parallel_size"] == 2 and cfg["gradient_accumulation_steps"] == 2
    assert check_rules(cfg, world_size=4) == [] or not errors(check_rules(cfg, world_size=4))


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 4, "sp": 2, "tp": 2}, "--sp 2 with --tp 2"),
    ({"world_size": 6, "sp": 4}, "world size 6 is not divisible by pp(1) * sp(4) = 4"),
])
def test_generate_config_refusals(kwargs, words):
    with pytest.raises(ConfigError) as exc:
        build_config(GenerateOptions(mbs=1, **kwargs))
    assert words in str(exc.value)


def test_zero3_without_reduce_scatter_is_refused_with_sp():
    cfg = dict(SP2, zero_optimization={"stage": 3, "reduce_scatter": False})
    [message] = errors(check_rules(cfg, world_size=4))
    assert '"reduce_scatter": false with ZeRO-3 and sp 2' in message


def test_plan_proposes_sp_for_a_long_sequence_and_counts_its_all_to_alls():
    from toolkit.plan.layouts.estimate import Layout, sp_comm_bytes
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    result = make_plan(PlanRequest(model="llama-3.2-1b", gpu="h100", gpus_per_node=8, gbs=8, seq_len=131072))
    assert result.fitting and result.best[0].layout.sp > 1
    best = result.best[0]
    assert best.sp_comm_bytes > 0 and best.times["sp_comm"] > 0
    # 4 all-to-alls forward + 4 backward per attention layer, each (sp - 1) / sp of the local tensor
    assert sp_comm_bytes(1000.0, Layout(1, 1, 0, 1, 1, sp=2)) == 2 * 1000 / 2 * 1 / 2
    assert sp_comm_bytes(1000.0, Layout(1, 1, 0, 1, 1)) == 0


def _packed_batch(rows=2, length=12, vocab=17, seed=0):
    """((input_ids, doc_ids), labels) of packed rows: documents of 5, 4 and 3 tokens, then 0 padding in row 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    doc_ids = torch.tensor([[1] * 5 + [2] * 4 + [3] * 3, [1] * 7 + [2] * 3 + [0] * 2])[:rows, :length]
    labels = torch.where(doc_ids > 0, ids, torch.full_like(ids, -100))
    return (ids, doc_ids), labels


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_pipeline_slices_and_their_losses_average_to_one_process_loss(sp):
    """Inside pipeline stages the engine averages the sp ranks' losses: each is sp x its slice's summed
    token losses / the micro-batch's targets, so their mean is the whole rows' causal-LM loss, and each
    slice's labels are the rows' shifted before slicing (a slice's last position predicts the next slice's
    first token)."""
    import torch

    from models.spec import causal_lm_loss
    from toolkit.distributed.sequence_parallel import PipelineLoss, stage_batch

    batch = _packed_batch()
    logits = torch.randn(2, 12, 17, generator=torch.Generator().manual_seed(1))
    losses, firsts = [], []
    for rank in range(sp):
        (ids, doc_ids), (shift, targets) = stage_batch(batch, sp, rank)
        part = slice(12 // sp * rank, 12 // sp * (rank + 1))
        assert torch.equal(ids, batch[0][0][:, part]) and torch.equal(doc_ids, batch[0][1])  # documents travel whole
        assert float(targets) == float((batch[1][:, 1:] != -100).sum())
        losses.append(PipelineLoss(sp)(logits[:, part], (shift, targets)))
        firsts.append(shift[:, -1])
    assert torch.allclose(torch.stack(losses).mean(), causal_lm_loss(logits, batch[1]), rtol=1e-6)
    assert torch.equal(firsts[0], batch[1][:, 12 // sp])  # the next slice's first label


def test_pipeline_slice_refuses_a_row_sp_does_not_divide():
    from toolkit.distributed.sequence_parallel import stage_batch

    with pytest.raises(ConfigError, match="12 tokens per row is not divisible by sp 5"):
        stage_batch(_packed_batch(), 5, 0)


def test_document_sdpa_keeps_packed_documents_apart_where_plain_causal_attention_would_not():
    """Ulysses hands its core attention the whole gathered sequence and no mask. dstk's core keeps each packed
    document to itself (each document attended alone gives the same outputs); plain causal sdpa, what
    DeepSpeed's Ulysses runs under sdpa, lets later documents see earlier ones."""
    import torch
    from torch.nn import Module
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from models.attention import positions
    from toolkit.distributed.sequence_parallel import document_sdpa

    (_, doc_ids), _ = _packed_batch()
    position_ids = positions(doc_ids)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))
    module = Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 1, False
    got, _ = document_sdpa(module, q, k, v, None, position_ids=position_ids, dropout=0.0, scaling=None)
    plain, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=None)
    for row, bounds in enumerate([[(0, 5), (5, 9), (9, 12)], [(0, 7), (7, 10), (10, 12)]]):
        for a, b in bounds:
            alone, _ = sdpa_attention_forward(module, q[row:row + 1, :, a:b], k[row:row + 1, :, a:b],
                                              v[row:row + 1, :, a:b], None, dropout=0.0, scaling=None)
            assert torch.allclose(got[row:row + 1, a:b], alone, atol=1e-6), (row, a, b)
    assert torch.allclose(got[:, :5], plain[:, :5], atol=1e-6)  # the first document sees nothing before it
    assert not torch.allclose(got[:, 7:], plain[:, 7:], atol=1e-3)  # later documents: plain causal mixes them


def _layouts(**kwargs):
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    request = dict(model="llama-3.2-1b", gpu="h100", gpu_mem=2**50, gpus_per_node=8, gbs=8, seq_len=32768)
    return make_plan(PlanRequest(**{**request, **kwargs}))  # memory enough for every layout to fit


def _estimate(result, **layout):
    return next(e for e in result.fitting
                if all(getattr(e.layout, k) == v for k, v in layout.items()))


def test_plan_counts_sp_inside_pipeline_stages_sends_slices_and_builds_no_mask():
    result = _layouts()
    whole = _estimate(result, pp=2, sp=1, tp=1, zero=1, mbs=1, checkpointing=False, offload="none")
    sliced = _estimate(result, pp=2, sp=2, zero=1, mbs=1, checkpointing=False, offload="none")
    assert sliced.layout.dp == whole.layout.dp // 2
    per_micro_batch = [e.pp_comm_bytes / e.layout.gas for e in (sliced, whole)]
    assert per_micro_batch[0] * 2 == per_micro_batch[1]  # each stage sends 1/sp of the hidden state
    assert sliced.sp_comm_bytes > 0 and whole.sp_comm_bytes == 0
    # no (seq x seq) mask under sp (each document runs causally), and half the tokens: less than half
    assert sliced.activations < whole.activations / 2


def test_plan_gives_flash_under_sp_one_row_per_micro_batch():
    result = _layouts(attention="flash_attention_2")
    with_sp = [e.layout for e in result.fitting if e.layout.sp > 1]
    assert with_sp and {lay.mbs for lay in with_sp} == {1}
    assert {e.layout.mbs for e in result.fitting if e.layout.sp == 1} != {1}


def test_plan_drops_the_mask_under_sp_at_pp_1():
    from toolkit.plan.cost.layers import mask_bytes

    result = _layouts(tiled_loss="off")  # the whole logits' peak halves under sp 2 as every other activation
    one, two = (_estimate(result, pp=1, sp=sp, tp=1, zero=3, mbs=1, checkpointing=False, offload="none")
                for sp in (1, 2))
    # one (T x T) mask for the model at pp = 1 (HF's, made additive once), none under sp
    assert one.activations - 2 * two.activations == mask_bytes(32768, 1, "bf16", "sdpa")


def test_document_sdpa_keeps_a_sliding_window_inside_each_document():
    """mistral / qwen2 layers pass their sliding_window: each query sees its last `window` keys, never across a
    document (the one case that builds a mask)."""
    import torch
    from torch.nn import Module
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from models.attention import positions
    from toolkit.distributed.sequence_parallel import document_sdpa

    (_, doc_ids), _ = _packed_batch()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))
    module = Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 1, False
    got, _ = document_sdpa(module, q, k, v, None, position_ids=positions(doc_ids), sliding_window=3, dropout=0.0,
                           scaling=None)
    index = torch.arange(12)
    near = (index[:, None] >= index[None, :]) & (index[:, None] - index[None, :] < 3)
    docs = positions(doc_ids).eq(0).cumsum(1)  # a document starts where its position is 0
    mask = near & (docs[:, None, :, None] == docs[:, None, None, :])
    want, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=None)
    assert torch.allclose(got, want, atol=1e-6)
    unwindowed, _ = document_sdpa(module, q, k, v, None, position_ids=positions(doc_ids), dropout=0.0, scaling=None)
    assert not torch.allclose(got, unwindowed, atol=1e-3)
