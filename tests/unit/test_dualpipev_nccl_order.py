"""DualPipeV's sends, receives and batches under NCCL's rules (tests/p2p_order.py; docs/deepspeed.md, "DualPipeV on
NCCL"): DeepSpeed 0.19.8's instruction streams finish for pp 2-8, with and without dp, training and evaluating.
The model itself finds a ring of blocking sends, the shapes moved behind the batch they announce, and the hang of
a batch_isend_irecv that is WORLD's first NCCL call (what toolkit.distributed.process_group.init's device
all_gather prevents). tests/distributed/test_dualpipev.py checks these streams against what real runs issue."""

import pytest

from tests.p2p_order import dualpipev_programs, stuck


def blocking(direction: str, peer: int) -> dict:
    return {"kind": direction, "ops": [[direction, peer, "x"]]}


def test_the_model_hangs_a_ring_of_blocking_sends_and_finishes_the_ring_batched_or_alternated():
    ring = [[blocking("send", (r + 1) % 4), blocking("recv", (r - 1) % 4)] for r in range(4)]
    assert sorted(stuck(ring)) == [0, 1, 2, 3]
    assert sorted(stuck(ring, "lazy")) == [0, 1, 2, 3]
    batched = [[{"kind": "batch", "ops": [["send", (r + 1) % 4, "x"], ["recv", (r - 1) % 4, "x"]]}] for r in range(4)]
    assert stuck(batched) == {} and stuck(batched, "lazy") == {}
    alternated = [units if r % 2 == 0 else units[::-1] for r, units in enumerate(ring)]  # even ranks send first
    assert stuck(alternated) == {}


def meta_unit(units: list, direction: str) -> int:
    return next(i for i, u in enumerate(units) if u["kind"] == direction and u["ops"][0][2] == "meta")


def test_shapes_sent_after_the_batch_they_announce_are_caught():
    """Mutation of DeepSpeed's order: rank 0 sends phase 0's shapes after its first batch of activations."""
    programs = dualpipev_programs(2, 4)
    at = meta_unit(programs[0], "send")
    programs[0].insert(at + 1, programs[0].pop(at))
    with pytest.raises(ValueError, match="meta"):  # one queue per pair: rank 1 would take activations for shapes
        stuck(programs)
    hung = stuck(programs, "lazy")  # the shapes on the pair's own communicator: each rank waits for the other
    assert hung[0][1]["kind"] == "batch" and hung[1][0] == meta_unit(programs[1], "recv") + 1  # (+1: a creation)


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 6, 8])
def test_deepspeeds_dualpipev_order_finishes_on_nccl(pp):
    for gas in (2 * pp, 2 * pp + 1):  # more micro-batches repeat the main step's pattern
        for dp in (1, 2):
            for forward_only in (False, True):
                programs = dualpipev_programs(pp, gas, dp, batches=2, forward_only=forward_only)
                assert stuck(programs) == {}, (gas, dp, forward_only)
                assert stuck(programs, "lazy") == {}, (gas, dp, forward_only)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_a_batch_creating_worlds_communicator_hangs_from_pp_3(pp):
    """torch: a batch_isend_irecv that is a group's first NCCL call needs every rank of the group in it. Stage 1's
    first batch is that call while stage 2 waits in its shapes' recv from stage 1, issued after that batch."""
    hung = stuck(dualpipev_programs(pp, 2 * pp, dp=2), "lazy", world_ready=False)
    if pp == 2:
        assert hung == {}  # stage 1 receives the shapes from stage 0, which sent them before its first batch
        return
    assert sorted(hung) == list(range(2 * pp))
    for rank, (_, unit) in hung.items():
        if rank // 2 < 2:
            assert unit.get("name") == "create world", (rank, unit)
        else:
            assert unit["kind"] == "recv" and unit["ops"][0][2] == "meta", (rank, unit)
