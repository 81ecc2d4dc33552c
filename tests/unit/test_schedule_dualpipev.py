"""`dstk schedule --schedule dualpipev`: DeepSpeed's DualPipeVSchedule timed next to its TrainSchedule."""

import json

import pytest

from tests.invoke import invoke_dstk
from toolkit.plan.dualpipev import timelines


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_every_rank_runs_both_phases_of_every_micro_batch_and_1f1b_keeps_its_formula(pp, m):
    t = timelines(pp, m)
    assert t["1f1b"].bubble == pytest.approx((pp - 1) / (m + pp - 1))  # the timing reproduces the formula
    for row in t["dualpipev"].rows:
        assert sorted((p.kind, p.phase, p.micro_batch) for p in row) == sorted(
            (k, ph, mb) for k in "FB" for ph in (0, 1) for mb in range(m))
        assert all(a.start + a.duration <= b.start for a, b in zip(row, row[1:]))  # one pass at a time
    assert 0 < t["dualpipev"].bubble < t["1f1b"].bubble  # two stages per rank fill part of 1F1B's bubble


def test_the_command_draws_both_and_their_bubbles(tmp_path):
    ran = invoke_dstk(["schedule", "--pp", "2", "--gas", "4", "--schedule", "dualpipev"])
    assert ran.returncode == 0, ran.stderr
    assert "1F1B TrainSchedule" in ran.stdout and "DualPipeVSchedule" in ran.stdout
    assert "bubble 11.1%" in ran.stdout and "bubble 20.0%" in ran.stdout, ran.stdout
    ran = invoke_dstk(["schedule", "--pp", "2", "--gas", "4", "--schedule", "dualpipev", "--json"])
    got = json.loads(ran.stdout)
    assert got["dualpipev"]["makespan"] == 27 and got["1f1b"]["makespan"] == 30
    png = tmp_path / "s.png"
    ran = invoke_dstk(["schedule", "--pp", "2", "--gas", "4", "--schedule", "dualpipev", "--png", str(png)])
    assert ran.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("pp, gas, said", [(2, 3, "--gas >= 2 x pp = 4 micro-batches"),
                                            (4, 7, "--gas >= 2 x pp = 8 micro-batches"), (1, 4, "--pp 2 or more")])
def test_too_few_micro_batches_or_stages_are_refused_naming_the_minimum(pp, gas, said):
    ran = invoke_dstk(["schedule", "--pp", str(pp), "--gas", str(gas), "--schedule", "dualpipev"])
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    assert said in ran.stderr and ran.stderr.count("error:") == 1, ran.stderr
