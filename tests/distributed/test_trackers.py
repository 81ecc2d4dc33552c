"""--report-to: a pp 2 run (forked ranks on gloo) logging to TensorBoard, Weights & Biases (offline) and MLflow
(a file store) at once, read back with each tool's own reader: the scalars of every step equal metrics.jsonl's,
the hyperparameters hold the run's arguments, DeepSpeed config and layout, rank 0 alone logged, and a
resumed run continues the same tracker runs. Then the refusals, before any model is built."""

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.test_pipeline_training import COMMON, plain_pytorch
from tests.ranks import run_train

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
MLFLOW = importlib.util.find_spec("mlflow") is not None
PER_STEP = ["train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second",
            "train/samples_per_second", "train/peak_memory_mib", "pipeline/stage_0/forward_seconds",
            "pipeline/stage_0/backward_seconds", "pipeline/stage_1/forward_seconds", "pipeline/stage_1/backward_seconds"]


def _env(tmp: Path) -> dict:
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": (tmp / "mlruns").as_uri(),
            "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_EXPERIMENT_NAME": "dstk-test"}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """(run folder, tmp, its metrics.jsonl step records) of a 4-step pp 2 run, no clipping, evaluated at
    step 2 and at the end, resumed for 2 more steps."""
    tmp = tmp_path_factory.mktemp("trackers")
    cfg = write_config(tmp / "ds.json", run_config(2, 4, 2))
    out = tmp / "run"
    assert COMMON[-2] == "--steps"
    args = ["--config", cfg, *COMMON[:-2], "--out", out, "--eval-every", "2", "--report-to", "tensorboard,wandb",
            *(["--report-to", "mlflow"] if MLFLOW else [])]
    rc, log = run_train([*args, "--steps", STEPS], 2, env=_env(tmp))
    assert rc == 0, log[-3000:]
    first = {r["step"]: r for r in _records(out)}
    first["summary"] = _summary(out)
    ids = json.loads((out / "trackers.json").read_text())
    rc, log = run_train([*args, "--steps", STEPS + 2, "--resume"], 2, env=_env(tmp))
    assert rc == 0, log[-3000:]
    return out, tmp, first, ids


def _records(out: Path) -> list:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]


def _summary(out: Path) -> dict:
    return [r["summary"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "summary" in r][-1]


def _expected(record: dict) -> dict:
    """metrics.jsonl's record under the trackers' names."""
    from toolkit.train.report.trackers import scalars

    return scalars(record)


def test_tensorboard_holds_every_steps_scalars_and_the_hyperparameters(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, first, _ = tracked
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 2, events  # one writer per launch, rank 0's alone (the first run, the resume)
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(PER_STEP) | {"eval/loss"} <= tags, sorted(tags)
    records = {r["step"]: r for r in _records(out)}
    assert sorted(records) == list(range(1, STEPS + 3))
    for tag in PER_STEP:
        logged = {e.step: e.value for e in acc.Scalars(tag)}
        assert sorted(logged) == list(range(1, STEPS + 3)), (tag, logged)
        for step, value in logged.items():
            assert value == pytest.approx(_expected(records[step])[tag], rel=1e-6), (tag, step)
    assert all(v > 0 for tag in PER_STEP if "pipeline/" in tag for v in (e.value for e in acc.Scalars(tag)))
    evals = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert evals[2] == pytest.approx(records[2]["eval_loss"]) and evals[STEPS + 2] == pytest.approx(_summary(out)["eval_loss"])
    assert evals[STEPS] == pytest.approx(first["summary"]["eval_loss"])  # the first launch's final evaluation
    text = acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    for expected in ("args/seq_len: 32", "args/model: tiny-gpt2", "layout/pp: 2", "deepspeed/pipeline/stages: 2",
                     "deepspeed/train_micro_batch_size_per_gpu: 2"):
        assert expected in text, text


def test_the_gradient_norm_without_clipping_is_plain_pytorchs(tracked):
    """No gradient_clipping at fp32 ZeRO 0: DeepSpeed computes no norm; dstk's counts each gradient once
    over the two stages (the tied embedding too), as torch.nn.utils.clip_grad_norm_ does at step 1."""
    out, _, first, _ = tracked
    _, norms = plain_pytorch()
    assert first[1]["grad_norm"] == pytest.approx(norms[1], rel=1e-4)


def _wandb_records(run_file: Path) -> list:
    """The records of a .wandb file (W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks
    with a 7-byte header each: crc32, length, type FULL/FIRST/MIDDLE/LAST), parsed with W&B's own protobuf."""
    from wandb.proto import wandb_internal_pb2

    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B", raw[:8]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # too little room left for a header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_files_hold_every_step_and_the_config(tracked):
    out, _, _, ids = tracked
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(ids["wandb"] in r.name for r in runs), (runs, ids)  # the resume continued the run
    records = {r["step"]: r for r in _records(out)}
    history, config = {}, {}
    for run in runs:
        for record in _wandb_records(next(run.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history[row["_step"]] = {**history.get(row["_step"], {}), **row}
            elif kind in ("run", "config"):  # the config comes with the run record, updates after it
                items = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    assert sorted(history) == list(range(1, STEPS + 3)), sorted(history)
    for step, row in history.items():
        for tag in PER_STEP:
            assert row[tag] == pytest.approx(_expected(records[step])[tag], rel=1e-6), (step, tag)
    assert history[STEPS + 2]["eval/loss"] == pytest.approx(_summary(out)["eval_loss"])
    assert config["args/seq_len"] == 32 and config["layout/pp"] == 2 and config["deepspeed/pipeline/stages"] == 2


@pytest.mark.skipif(not MLFLOW, reason="mlflow is not installed (an extra: DeepSpeed imports it when present, "
                    "~1.6 s on every fresh import)")
def test_mlflow_holds_every_step_and_the_parameters(tracked, monkeypatch):
    out, tmp, _, ids = tracked
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.data.params["args/seq_len"] == "32" and run.data.params["layout/dp"] == "1"
    records = {r["step"]: r for r in _records(out)}
    for tag in ("train/loss", "train/grad_norm", "pipeline/stage_1/backward_seconds"):
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert sorted(logged) == list(range(1, STEPS + 3)), (tag, logged)  # one run across the resume
        assert all(v == pytest.approx(_expected(records[s])[tag], rel=1e-6) for s, v in logged.items()), tag
    assert len(client.search_runs([run.info.experiment_id])) == 1


# ---------------------------------------------------------------- refusals, before any model is built


def _check(tmp: Path, *flags, blocked: str = "", cfg: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m toolkit.train --check` in a fresh process; `blocked`: a module made unimportable there
    (sys.modules[name] = None, Python's own way to say a package is absent)."""
    config = write_config(tmp / "ds.json", cfg or run_config(2, 4, 2))
    code = (f"import sys; sys.modules[{blocked!r}] = None; " if blocked else "") + \
        "from toolkit.cli import main; sys.argv[0] = 'dstk'; main(['train', *sys.argv[1:]])"
    return subprocess.run([sys.executable, "-c", "import sys\n" + code, "--config", str(config),
                           "--model", "tiny-gpt2", "--data", str(REPO / "toolkit/corpus/corpus.txt"),
                           "--out", str(tmp / "out"), "--check", *flags],
                          capture_output=True, text=True, cwd=REPO, env={**_env(tmp), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("flags, blocked, expected", [
    (["--report-to", "tensorbord"], "", "--report-to tensorbord: no such tracker; did you mean tensorboard?"),
    (["--report-to", "wandb,none"], "", "--report-to none with wandb"),
    (["--report-to", "wandb"], "wandb", "--report-to wandb: the wandb package is not installed here; pip install wandb"),
    (["--report-to", "mlflow"], "mlflow", "the mlflow package is not installed here; pip install mlflow"),
], ids=["typo", "none-and-one", "wandb-missing", "mlflow-missing"])
def test_a_tracker_that_cannot_log_is_refused_by_check(tmp_path, flags, blocked, expected):
    done = _check(tmp_path, *flags, blocked=blocked)
    assert done.returncode != 0 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stderr.count(expected) == 1


def test_wandb_online_without_a_key_is_refused(tmp_path):
    env = {k: v for k, v in _env(tmp_path).items() if k != "WANDB_MODE"}
    config = write_config(tmp_path / "ds.json", run_config(2, 4, 2))
    done = subprocess.run([sys.executable, "-m", "toolkit.train", "--config", str(config), "--model", "tiny-gpt2",
                           "--data", str(REPO / "toolkit/corpus/corpus.txt"), "--out", str(tmp_path / "out"), "--check",
                           "--report-to", "wandb"], capture_output=True, text=True, cwd=REPO,
                          env={**env, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NETRC": str(tmp_path / "none")})
    assert done.returncode != 0 and "no W&B API key here" in done.stderr and "WANDB_MODE=offline" in done.stderr, \
        done.stderr[-2000:]


@pytest.mark.parametrize("section, blocked, expected", [
    ({"wall_clock_breakdown": True}, "", '"wall_clock_breakdown": true with 2 pipeline stages'),
    ({"wandb": {"enabled": True}}, "wandb", '"wandb": {"enabled": true} needs the wandb package'),
    ({"comet": {"enabled": True}}, "", '"comet": {"enabled": true} needs the comet_ml package'),
], ids=["wall-clock-breakdown-pp2", "deepspeed-wandb-missing", "deepspeed-comet-missing"])
def test_deepspeed_settings_that_would_fail_late_are_refused_by_check(tmp_path, section, blocked, expected):
    done = _check(tmp_path, cfg={**run_config(2, 4, 2), **section}, blocked=blocked)
    assert done.returncode != 0 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_tracker_folder_that_cannot_be_written_is_refused_by_check_and_dropped_by_a_run(tmp_path, capsys):
    """OUT/tensorboard unwritable (here a file where the folder goes: root writes through permissions) once killed
    the run when the tracker opened; --check now names it, and a run that meets it anyway (made meanwhile)
    names the tracker once and trains on, as docs/training.md says of a failing tracker."""
    from toolkit.checkpoint.run_folder import RunFolder
    from toolkit.train.report.trackers import Trackers

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tensorboard").write_text("not a folder")
    done = _check(tmp_path, "--report-to", "tensorboard")
    expected = f"--report-to tensorboard logs into {tmp_path / 'out' / 'tensorboard'}, which is a file"
    assert done.returncode != 0 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stderr.count(expected) == 1
    trackers = Trackers(("tensorboard",), RunFolder(tmp_path / "out"), {"lr": 1e-3}, resume=False)
    assert trackers.open == [] and trackers.where() == ""
    err = capsys.readouterr().err
    assert err.count("warning: --report-to tensorboard failed and is dropped") == 1, err
