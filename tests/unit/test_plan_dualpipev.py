"""`dstk plan` and DualPipeV: the closed forms it uses (bubble, micro-batches in flight) against DeepSpeed's own
DualPipeVSchedule instruction stream, and dualpipev layouts ranked beside 1F1B ones."""

import pytest

from toolkit.plan.layouts.estimate import Layout, dualpipev_bubble
from toolkit.plan.layouts.planner import PlanRequest, estimate_layout, make_plan
from toolkit.plan.memory.rank import in_flight_dualpipev


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 9), (3, 6), (4, 8), (4, 16), (6, 13), (8, 16)])
def test_bubble_and_in_flight_are_deepspeeds_instruction_streams(pp, m):
    from deepspeed.runtime.pipe import schedule as ds

    from toolkit.plan.dualpipev import timelines

    assert timelines(pp, m)["dualpipev"].bubble == pytest.approx(dualpipev_bubble(pp, m))
    for rank in range(pp):
        alive, peak = [0, 0], [0, 0]
        for step in ds.DualPipeVSchedule(m, pp, rank).steps():
            for cmd in step:
                if isinstance(cmd, (ds.ForwardPass, ds.BackwardPass)):
                    alive[cmd.phase] += 1 if isinstance(cmd, ds.ForwardPass) else -1
                    peak = [max(a, b) for a, b in zip(peak, alive)]
        assert peak == [in_flight_dualpipev(pp, rank), in_flight_dualpipev(pp, 2 * pp - 1 - rank)]


REQ = PlanRequest(model="gpt2-xl", gpu="a10g", gpus_per_node=4, gbs=64, seq_len=1024, top=12)


def test_dualpipev_trades_bubble_for_activations_and_p2p():
    one = estimate_layout(REQ, Layout(pp=4, dp=1, zero=1, mbs=2, gas=32))
    two = estimate_layout(REQ, Layout(pp=4, dp=1, zero=1, mbs=2, gas=32, schedule="dualpipev"))
    assert len(two.parts) == 9 and two.bubble == pytest.approx(11 / (6 * 32 + 11)) and two.bubble < one.bubble
    assert two.times["bubble"] < one.times["bubble"]
    assert two.pp_comm_bytes == 2 * one.pp_comm_bytes  # out through phase 0 and back through phase 1
    assert two.activations > one.activations  # every rank keeps 2 pp + 1 half-stage micro-batches


def test_the_planner_ranks_dualpipev_layouts_with_1f1b_ones():
    result = make_plan(REQ)
    schedules = {e.layout.schedule for e in result.fitting}
    assert schedules == {"1f1b", "dualpipev"}
    assert all(e.layout.gas >= 2 * e.layout.pp for e in result.fitting if e.layout.schedule == "dualpipev")
    best = result.best[0]
    assert best.layout.schedule == "dualpipev" and "dualpipev" in best.layout.describe()  # gpt2-xl on 4 A10G
