"""`dstk export` on a run folder, a missing tag, a truncated file and an existing OUT_DIR: it finds
RUN_DIR/checkpoints, lists the tags there are, refuses cleanly, and never leaves a half-written export."""

import pytest

from tests.invoke import invoke_dstk
from toolkit.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as `dstk train` leaves it (pp = 1): checkpoints/{global_step2,global_step4,latest,dstk/}."""
    import torch

    from toolkit.train import hf
    from toolkit.checkpoint.manifest import save_meta, write_latest
    from toolkit.train.parity import small_model

    run = tmp_path_factory.mktemp("run")
    ckpt = run / "checkpoints"
    model = small_model("gpt2")
    for step in (2, 4):
        (ckpt / f"global_step{step}").mkdir(parents=True)
        torch.save({"module": model.state_dict()}, ckpt / f"global_step{step}" / "mp_rank_00_model_states.pt")
    save_meta(ckpt, model.config, hf.byte_tokenizer(), {"task": "causal-lm", "pp": 1})
    write_latest(ckpt, "global_step4")
    return run, model


def export(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", *map(str, args)])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_a_run_folder_is_read_through_its_checkpoints(capsys, tmp_path, run_dir):
    from transformers import AutoModelForCausalLM

    run, model = run_dir
    code, out, err = export(capsys, run, tmp_path / "hf")
    assert code == 0 and f"reading {run / 'checkpoints'}" in err, err
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (reloaded.transformer.wte.weight == model.transformer.wte.weight).all()
    assert leftovers(tmp_path) == []


def test_an_existing_export_is_replaced_only_with_force(capsys, tmp_path, run_dir):
    run, _ = run_dir
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("keep me")
    code, _, err = export(capsys, run / "checkpoints", out_dir)
    assert code == 1 and "already holds files; pass --force" in err
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]
    code, _, err = export(capsys, run / "checkpoints", out_dir, "--force")
    assert code == 0, err
    assert "keep.txt" not in {p.name for p in out_dir.iterdir()} and (out_dir / "config.json").is_file()
    assert leftovers(tmp_path) == []  # neither the temp folder nor the old export


def test_a_missing_tag_lists_the_tags(capsys, tmp_path, run_dir):
    run, _ = run_dir
    code, _, err = export(capsys, run, tmp_path / "hf", "--tag", "global_step9")
    assert code == 1 and "no tag global_step9; tags are global_step2, global_step4" in err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_without_a_checkpoint_is_refused(capsys, tmp_path):
    code, _, err = export(capsys, tmp_path, tmp_path / "hf")
    assert code == 2 and "was not written by dstk train" in err and "checkpoints/" in err
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_checkpoint_is_one_line_and_leaves_nothing(tmp_path, run_dir):
    import shutil

    run, _ = run_dir
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    pt = copy / "checkpoints" / "global_step4" / "mp_rank_00_model_states.pt"
    pt.write_bytes(pt.read_bytes()[:1000])
    result = invoke_dstk(["export", copy, tmp_path / "hf"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"error: {pt} cannot be read" in result.stderr and "truncated" in result.stderr and "--tag" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no hf/, no temp folder


@pytest.mark.parametrize("where, words", [
    ("under-a-file", "is a file, so nothing can be made under it"),
    ("/sys/dstk-hf", "cannot write in /sys (Permission denied)"),  # read-only for root too
])
def test_an_out_dir_that_cannot_be_written_is_refused_before_the_checkpoint_is_read(capsys, tmp_path, run_dir,
                                                                                  monkeypatch, where, words):
    from toolkit.export import directory

    run, _ = run_dir
    (tmp_path / "file").write_text("")
    out_dir = tmp_path / "file" / "hf" if where == "under-a-file" else where
    monkeypatch.setattr(directory, "read_manifest", lambda *_: pytest.fail("read the checkpoint first"))
    code, out, err = export(capsys, run, out_dir)
    assert code == 1 and words in err and "Traceback" not in err, err


def test_an_export_into_its_own_run_or_a_link_to_nowhere_is_refused(capsys, tmp_path, run_dir):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir[0], run)
    before = sorted(p.name for p in run.rglob("*"))
    for out_dir in (run, run / "checkpoints"):
        code, _, err = export(capsys, run, out_dir, "--force")
        assert code == 1 and "would replace the checkpoint it is exported from" in err, err
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    code, _, err = export(capsys, run, link)
    assert code == 1 and "is a link to" in err and "Traceback" not in err, err
    assert sorted(p.name for p in run.rglob("*")) == before
