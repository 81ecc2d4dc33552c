"""`dstk reshard` and resuming on another layout, in one process (a gloo world of one; the multi-process
moves are tests/distributed/test_resume_layouts.py): the portable state equals the checkpoint's, a run
continued on another ZeRO stage gives the uninterrupted run's losses and weights, and what cannot move
is refused before anything is built."""

import json

import pytest

from tests.unit.test_launch import _args
from toolkit.cli import main
from toolkit.errors import ConfigError
from toolkit.checkpoint import portable


def _losses(out):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "step" in r}


def test_reshard_writes_the_checkpoints_state_by_hf_name_and_the_run_continues_there(ds_world1, tmp_path, capsys):
    from toolkit.checkpoint.state import load_state_dict
    from toolkit.train.runner import run

    whole = tmp_path / "whole"
    whole.mkdir()
    run(_args(whole, 1, steps=6, save_every=3, export=False, eval_fraction=0))  # ZeRO-1, 6 steps
    half = tmp_path / "half"
    half.mkdir()
    run(_args(half, 1, steps=3, export=False, eval_fraction=0))
    original = portable.read(half / "run" / "checkpoints")
    capsys.readouterr()  # the runs' own output
    with pytest.raises(SystemExit) as done:
        main(["reshard", str(half / "run"), str(tmp_path / "moved"), "--zero", "0", "--json"])
    assert done.value.code in (0, None)
    summary = json.loads(capsys.readouterr().out)
    assert summary["from"]["zero_stage"] == 1 and summary["to"]["zero_stage"] == 0 and summary["tag"] == "global_step3"
    moved = portable.read(tmp_path / "moved" / "checkpoints")
    assert moved.optimizer_step == original.optimizer_step == 3
    for kind in portable.MOMENTS:
        assert set(moved.moments[kind]) == set(original.moments[kind])
        assert all((moved.moments[kind][k] == original.moments[kind][k].reshape(moved.moments[kind][k].shape)).all()
                   for k in original.moments[kind])
    # the moved run continues on ZeRO-0 (its config) from step 3 as the ZeRO-1 run went on
    cont = _args(tmp_path / "moved", 0, steps=6, save_every=3, export=False, eval_fraction=0, resume=True)
    cont.out = str(tmp_path / "moved")
    run(cont)
    want, got = _losses(whole / "run"), _losses(tmp_path / "moved")
    for step in (4, 5, 6):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
    a = load_state_dict(whole / "run" / "checkpoints", "global_step6")[0]
    b = load_state_dict(tmp_path / "moved" / "checkpoints", "global_step6")[0]
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.parametrize("flags, words", [
    (["--pp", "2", "--zero", "2"], "--zero 2 with --pp 2: DeepSpeed's pipeline engine supports ZeRO 0 and 1 only"),
    (["--dp", "0"], "--dp must be a positive integer, got 0"),
    (["--pp", "9"], "--pp 9 is more stages than the model's 7 pipeline layers; use --pp <= 7"),  # from a pp 1 run
])
def test_moves_that_cannot_be_honoured_are_refused(ds_world1, tmp_path, capsys, flags, words):
    from toolkit.train.runner import run

    run(_args(tmp_path, 0, steps=2, export=False, eval_fraction=0))
    with pytest.raises(SystemExit) as done:
        main(["reshard", str(tmp_path / "run"), str(tmp_path / "out"), *flags])
    assert done.value.code == 1
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and not (tmp_path / "out").exists()


def test_an_older_checkpoint_without_named_optimizer_states_cannot_move(tmp_path):
    from toolkit.checkpoint.manifest import check_resumable

    meta = tmp_path / "dstk"
    meta.mkdir()
    (meta / "manifest.json").write_text(json.dumps({"model": "m", "pp": 2, "dp": 1, "zero_stage": 0}))
    with pytest.raises(ConfigError, match="written by an older dstk that did not name its optimizer states"):
        check_resumable(tmp_path, {"model": "m", "pp": 1, "dp": 2, "zero_stage": 0})
    assert check_resumable(tmp_path, {"model": "m", "pp": 2, "dp": 1, "zero_stage": 0}) == []  # same layout


def test_resuming_with_other_data_is_refused_before_anything_is_built(ds_world1, tmp_path):
    from toolkit.train.runner import run

    run(_args(tmp_path, 0, steps=2, export=False, eval_fraction=0))
    other = tmp_path / "other.txt"
    other.write_text("another corpus\n\nwith two documents\n")
    with pytest.raises(ConfigError, match=r"another run \(--data [^ ]*other\.txt: not the content the checkpoint read "
                                          r"from [^ ]*corpus\.txt \(sha256 \w{12}, 220692 bytes then; \w{12}, 35 bytes "
                                          r"now\); data\.seed: checkpoint 1234, now 7\)"):
        run(_args(tmp_path, 0, steps=4, export=False, eval_fraction=0, resume=True, data=str(other), seed=7))


def test_a_tensor_parallel_checkpoint_is_not_resharded(tmp_path, capsys):
    (tmp_path / "ckpt" / "dstk").mkdir(parents=True)
    (tmp_path / "ckpt" / "dstk" / "manifest.json").write_text(json.dumps({"model": "m", "pp": 1, "dp": 1, "tp": 2,
                                                                          "zero_stage": 1}))
    (tmp_path / "ckpt" / "global_step2").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    with pytest.raises(SystemExit) as done:
        main(["reshard", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dp", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 1 and "tensor-parallel run (tp 2)" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_run_written_before_the_manifest_had_its_name_exports_resumes_and_moves(ds_world1, tmp_path):
    """An older dstk wrote dstk/layout.json and <tag>/dstk-layout.json: still read. A move to another layout
    writes dstk/manifest.json (the stale layout.json goes); the older tag keeps its own copy."""
    from toolkit.export.directory import export
    from toolkit.train.runner import run

    run(_args(tmp_path, 1, steps=2, export=False, eval_fraction=0))  # ZeRO-1
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "dstk" / "manifest.json").rename(ckpt / "dstk" / "layout.json")
    for own in ckpt.glob("*/dstk-manifest.json"):
        own.rename(own.with_name("dstk-layout.json"))
        (own.parent / "dstk-files.json").unlink()  # an older dstk listed no tag's files
    assert not list(ckpt.rglob("*manifest.json"))
    export(ckpt, tmp_path / "hf_old")
    assert (tmp_path / "hf_old" / "config.json").is_file()
    run(_args(tmp_path, 0, steps=4, export=False, eval_fraction=0, resume=True))  # moves to ZeRO-0
    assert json.loads((ckpt / "dstk" / "manifest.json").read_text())["zero_stage"] == 0
    assert not (ckpt / "dstk" / "layout.json").exists()
    assert json.loads((ckpt / "global_step2" / "dstk-layout.json").read_text())["zero_stage"] == 1
    assert not (ckpt / "global_step2" / "dstk-manifest.json").exists()
    export(ckpt, tmp_path / "hf_new", tag="global_step2")  # through its own old-named copy
    export(ckpt, tmp_path / "hf_latest")


def test_resuming_from_a_checkpoint_with_a_file_deleted_names_the_file_the_step_and_the_whole_ones(ds_world1, tmp_path):
    """A tag records its files once every rank saved (dstk-files.json); --resume from a tag that lost one
    (or has one cut short) is refused before anything is built, naming it and the tags that are whole."""
    from tests.unit.test_train_refusals import train_cli
    from toolkit.train.runner import run

    args = _args(tmp_path, 0, steps=4, save_every=2, export=False, eval_fraction=0)
    run(args)
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    lost = next(p for p in sorted((ckpt / "global_step4").iterdir()) if p.name.endswith("model_states.pt"))
    lost.unlink()
    result = train_cli(tmp_path, "--resume", "--steps", "6", "--eval-fraction", "0", "--check", config=args.config)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (f"checkpoint global_step4 (step 4) in {ckpt} is not whole: {lost.name} is missing; whole checkpoints: "
            f"global_step2; to resume from global_step2, write global_step2 into {ckpt / 'latest'}") in result.stderr
    (ckpt / "latest").write_text("global_step2")
    assert train_cli(tmp_path, "--resume", "--steps", "6", "--eval-fraction", "0", "--check", config=args.config).returncode == 0
    truncated = ckpt / "global_step2" / lost.name
    truncated.write_bytes(truncated.read_bytes()[:100])
    result = train_cli(tmp_path, "--resume", "--steps", "6", "--eval-fraction", "0", "--check", config=args.config)
    assert f"{lost.name} has 100 bytes, not the" in result.stderr and "no other checkpoint here is whole" in result.stderr


def test_resuming_on_another_token_stream_is_refused_naming_it_unless_resume_with_new_data(ds_world1, tmp_path):
    """A chat template, --train-on, --seq-len or tokenizer file that changed would resume on other tokens:
    --check (and the run) name what changed; --resume-with-new-data continues on the new stream."""
    from tests.unit.test_train_refusals import refused, train_cli
    from toolkit.train.runner import run

    first, second = tmp_path / "a.jinja", tmp_path / "b.jinja"
    first.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    second.write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    args = _args(tmp_path, 0, steps=2, export=False, eval_fraction=0, chat_template=str(first))
    run(args)

    def resume(*flags):
        return train_cli(tmp_path, "--resume", "--steps", "4", "--eval-fraction", "0", "--check", *flags,
                         config=args.config)

    assert resume("--chat-template", str(first)).returncode == 0
    refused(resume("--chat-template", str(second)), 1, "data.chat_template: checkpoint '", "--resume-with-new-data")
    refused(resume("--chat-template", str(first), "--train-on", "all"), 1,
            "data.train_on: checkpoint 'assistant', now 'all'")
    refused(resume("--chat-template", str(first), "--seq-len", "16"), 1, "seq_len: checkpoint 32, now 16")
    assert resume("--chat-template", str(second), "--seq-len", "16", "--resume-with-new-data").returncode == 0
    refused(train_cli(tmp_path, "--resume-with-new-data", "--overwrite", "--check", config=args.config), 1,
            "--resume-with-new-data continues a run: pass it with --resume")
