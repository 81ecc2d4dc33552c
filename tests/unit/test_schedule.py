"""toolkit.plan.schedule: the timeline read from DeepSpeed's TrainSchedule, its bubble, and `dstk schedule`."""

import importlib.util

import pytest

from toolkit.cli import main
from toolkit.errors import ConfigError
from toolkit.plan.schedule import IDLE, render_ascii, train_timeline

CASES = [(1, 1), (1, 4), (2, 1), (2, 3), (3, 5), (4, 4), (4, 8), (5, 2), (8, 16)]


@pytest.mark.parametrize("pp,m", CASES)
def test_idle_share_equals_formula(pp, m):
    t = train_timeline(pp, m)
    assert t.steps == 2 * (m + pp - 1)
    assert t.bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m", CASES)
def test_every_stage_runs_each_micro_batch_once_in_dependency_order(pp, m):
    t = train_timeline(pp, m)
    when = {}  # (kind, stage, micro_batch) -> step
    for s, row in enumerate(t.rows):
        cells = [c for c in row if c is not IDLE]
        assert sorted(cells) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        when.update({(c[0], s, c[1]): k for k, c in enumerate(row) if c is not IDLE})
    for i in range(m):
        for s in range(pp):
            assert when["F", s, i] < when["B", s, i]
            if s + 1 < pp:  # activations flow down, gradients flow back up
                assert when["F", s, i] < when["F", s + 1, i] and when["B", s + 1, i] < when["B", s, i]


def test_buffers_are_deepspeeds_in_flight_counts():
    assert train_timeline(4, 8).buffers == [4, 3, 2, 2]


def test_ascii_has_one_row_per_stage_and_the_bubble():
    text = render_ascii(train_timeline(3, 4))
    rows = [line for line in text.splitlines() if line.startswith("stage ")]
    assert [row.split("|")[0].split() for row in rows] == [["stage", str(s)] for s in range(3)]
    assert "bubble: 33.3%" in text and "2/6" in text


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="--micro-batches"):
        train_timeline(2, 0)


def run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["schedule", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_cli_draws_and_exits_zero(capsys):
    code, out, _ = run(capsys, "--pp", "2", "--micro-batches", "3")
    assert code == 0 and "stage  1" in out and "25.0%" in out


def test_cli_rejects_zero_stages(capsys):
    code, _, err = run(capsys, "--pp", "0", "-m", "3")
    assert code == 1 and "--pp must be a positive integer" in err


def test_cli_png(capsys, tmp_path):
    path = tmp_path / "s.png"
    code, _, err = run(capsys, "--pp", "2", "-m", "2", "--png", str(path))
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 1 and "needs matplotlib" in err and not path.exists()
    else:
        assert code == 0 and path.read_bytes()[:4] == b"\x89PNG"
