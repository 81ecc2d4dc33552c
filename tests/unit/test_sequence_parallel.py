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


def test_sp_with_pipeline_stages_is_refused_for_now():
    cfg = dict(SP2, train_batch_size=2, pipeline={"stages": 2})
    [message] = errors(check_rules(cfg, world_size=4))
    assert "not yet: sp inside pipeline stages is planned" in message and "use pp 1 with sp 2" in message


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
    ({"world_size": 4, "sp": 2, "pp": 2}, "--sp 2 with 2 pipeline stages: not yet"),
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
