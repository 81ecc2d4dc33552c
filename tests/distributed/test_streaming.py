"""`dstk train --streaming`: rows read from a datasets IterableDataset, sharded by dp rank, the position saved
with each checkpoint; a run stopped at step k and resumed goes on exactly as the run that was not stopped.

Each resume test: three launches of 2 CPU ranks, ~13 s on 2 cores.
"""

import json
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import CORPUS, launch

pytestmark = pytest.mark.distributed

STREAM = ["--model", "tiny-gpt2", "--data", str(CORPUS), "--seq-len", "32", "--no-progress", "--streaming",
          "--eval-fraction", "0", "--no-export"]


def losses(out: Path) -> dict:
    """step -> loss from metrics.jsonl (a resumed run's later lines win)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "step" in r}


@pytest.mark.parametrize("pp, dp_ranks", [(1, [0, 1]), (2, [0, 0])])
def test_streaming_resume_equals_an_uninterrupted_run(tmp_path, pp, dp_ranks):
    """2 ranks (dp 2, or pp 2 x dp 1: both stages read the replica's rows), 2 micro-batches of 2 rows a step: 8 steps
    straight through, and a run killed after step 4 (saved at 3, mid-run) then --resume to 8, give the same losses
    at every step (1e-6 relative); each rank saved its own place in its share of the stream."""
    cfg = write_config(tmp_path / "cfg.json", run_config(2, 2, pp, clip=1.0))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    rc, log = launch(cfg, whole, 2, "--steps", 8, model_args=STREAM)
    assert rc == 0, log[-3000:]
    rc, log = launch(cfg, parts, 2, "--steps", 8, "--save-every", 3, "--crash-at-step", 4, model_args=STREAM)
    assert rc != 0 and max(losses(parts)) == 4, log[-3000:]  # the last rank killed itself after step 4
    tag = parts / "checkpoints" / "global_step3"
    positions = [json.loads((tag / f"data_position_{r}.json").read_text()) for r in (0, 1)]
    assert [p["dp_rank"] for p in positions] == dp_ranks
    assert all(p["rows"] == 3 * 2 * 2 and p["docs"] == 0 and p["pass"] == 0 for p in positions), positions
    rc, log = launch(cfg, parts, 2, "--steps", 8, "--resume", model_args=STREAM)
    assert rc == 0, log[-3000:]
    a, b = losses(whole), losses(parts)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(abs(a[s] - b[s]) <= 1e-6 * abs(a[s]) for s in a), (a, b)
    assert len({round(v, 6) for v in a.values()}) > 4  # the steps saw different rows, not one repeated batch


def test_streaming_evaluates_on_eval_data_and_its_checkpoint_is_not_resumed_without_streaming(tmp_path):
    """--eval-data is prepared as usual and evaluated at the end; resuming a --streaming run's checkpoint without
    --streaming is refused before any rank starts (another token stream), with the fix."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": f"held out document number {i}."}) + "\n" for i in range(6)))
    cfg = write_config(tmp_path / "dp2.json", run_config(2, 1, 1))
    out = tmp_path / "run"
    rc, log = launch(cfg, out, 2, "--steps", 2, "--eval-data", held, model_args=STREAM)
    assert rc == 0, log[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["summary"]["eval_loss"] for r in lines if "summary" in r][0] > 0
    plain = [a for a in STREAM if a != "--streaming"]
    rc, log = launch(cfg, out, 2, "--steps", 3, "--eval-data", held, "--resume", model_args=plain)
    assert rc != 0 and "Traceback" not in log and "another run" in log and "streaming" in log, log[-3000:]


def _train(cfg: Path, out: Path, procs: int, *flags) -> str:
    from tests.ranks import run_train

    rc, log = run_train(["--config", cfg, *STREAM, "--out", out, *flags], procs)
    assert rc == 0, log[-3000:]
    return log


def _continues(moved: Path, whole: Path, steps) -> None:
    got, want = losses(moved), losses(whole)
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in steps), ({s: got[s] for s in steps}, want)


@pytest.mark.parametrize("case", ["dualpipev->1f1b", pytest.param("pp3->pp2", marks=pytest.mark.heavy),
                                  pytest.param("reshard pp2->pp1", marks=pytest.mark.heavy)])
def test_a_streaming_run_moved_to_another_pipeline_reads_its_replicas_rows(tmp_path, case):
    """Only the ranks that load micro-batches advance their stream position (DualPipeV: pipe rank 0; 1F1B: the first
    and last stages), so a rank that never read it could become one that reads labels after a move, and train on
    another row's (+1.4% loss at steps 4-6). The place is found per data-parallel replica: the moved run continues
    the run that was not moved (1e-4: DualPipeV and 1F1B agree to that)."""
    from tests.invoke import invoke_dstk

    cfg2 = write_config(tmp_path / "pp2.json", run_config(2, 4, 2, clip=1.0))
    log = _train(cfg2, tmp_path / "whole", 2, "--steps", 6)
    said = [line for line in log.splitlines() if line.startswith("data: ")]  # a stream says what it reads, too
    assert len(said) == 1 and said[0].startswith(f"data: --streaming {CORPUS}: format text") and "rows of 32" in said[0]
    data = json.loads((tmp_path / "whole" / "summary.json").read_text())["data"]
    assert data["streaming"] and data["format"] == "text" and data["position"]["rows"] == 6 * 4 * 2, data
    part = tmp_path / "part"
    if case == "dualpipev->1f1b":
        _train(cfg2, part, 2, "--steps", 3, "--schedule", "dualpipev")
        _train(cfg2, part, 2, "--steps", 6, "--resume")
        moved = part
    elif case == "pp3->pp2":
        _train(write_config(tmp_path / "pp3.json", run_config(2, 4, 3, clip=1.0)), part, 3, "--steps", 3)
        _train(cfg2, part, 2, "--steps", 6, "--resume")
        moved = part
    else:
        _train(cfg2, part, 2, "--steps", 3)
        moved = tmp_path / "moved"
        done = invoke_dstk(["reshard", str(part), str(moved), "--pp", "1"])
        assert done.returncode == 0, done.stderr
        _train(write_config(tmp_path / "pp1.json", run_config(2, 4, 1, clip=1.0)), moved, 1, "--steps", 6, "--resume")
        refused = invoke_dstk(["reshard", str(part), str(tmp_path / "dp2"), "--dp", "2"])
        assert refused.returncode == 1 and "is a --streaming run" in refused.stderr and "keeps dp 1" in refused.stderr
    _continues(moved, tmp_path / "whole", [4, 5, 6])
