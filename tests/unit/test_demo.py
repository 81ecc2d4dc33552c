"""The demo (toolkit/train/demo.py) on machines with 0, 1 and 2+ GPUs: its two pipeline stages need two
devices, so with one GPU they run as CPU processes and it says why (NCCL refuses two ranks on one GPU)."""

import click
import pytest

from toolkit.train.demo import demo_config, on_cpu_because


@pytest.mark.parametrize("gpus, cpu", [(0, False), (1, True), (2, False), (8, False)])
def test_one_gpu_runs_the_demo_on_cpu_and_says_why(gpus, cpu):
    why = on_cpu_because(gpus)
    assert (why is not None) == cpu
    if cpu:
        assert "NCCL refuses two ranks on one GPU" in why


def test_the_demo_config_is_a_two_stage_pipeline_without_jit_built_ops(tmp_path):
    import json

    cfg = json.loads(demo_config(tmp_path, 1e-3).read_text())
    assert cfg["pipeline"]["stages"] == 2 and cfg["optimizer"]["params"]["torch_adam"] is True


def test_the_demo_refuses_an_out_folder_with_the_users_files_unless_overwrite(tmp_path):
    """The demo deletes --out: a folder with files that no demo made needs --overwrite, and nothing in it
    is touched when refused; a previous demo's folder is replaced without asking."""
    from click.testing import CliRunner

    from toolkit.train import demo

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(demo.main, ["--out", str(mine), "--steps", "1"])
    assert result.exit_code == 1 and "already holds files (notes.txt)" in result.output
    assert "--overwrite" in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    demo.check_out(mine, overwrite=True)  # allowed
    (mine / demo.MARK).write_text("")
    demo.check_out(mine, overwrite=False)  # a previous demo's folder
    (tmp_path / "file").write_text("")
    with pytest.raises(click.ClickException, match="is a file"):
        demo.check_out(tmp_path / "file", overwrite=True)


def test_the_demo_refuses_an_out_it_cannot_write_and_keeps_its_config_out_of_out(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from toolkit.train import demo

    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    for out, words in ((link, "is a link to"), (tmp_path / "file" / "sub", "is a file, so nothing can be made")):
        result = CliRunner().invoke(demo.main, ["--out", str(out), "--steps", "1"])
        assert result.exit_code == 1 and words in result.output, result.output
    seen = {}
    def launch(config, out, steps, model):  # what launch.sh would get; the run folder as a run leaves it
        seen.update(config=config, out=out)
        out.mkdir(parents=True)
        return 0

    monkeypatch.setattr(demo, "launch_run", launch)
    monkeypatch.setattr(demo, "report", lambda out: None)
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(demo.main, ["--out", "rel", "--steps", "1"]).exit_code == 0
    assert seen["out"] == tmp_path / "rel"  # absolute: launch.sh runs in the repository
    assert tmp_path / "rel" not in seen["config"].parents  # the config never lies in the folder --overwrite clears


def test_the_demo_prints_the_loss_table_once(tmp_path, monkeypatch, capsys):
    """The run (rank 0, through launch.sh) prints the table; the demo then adds only its sample."""
    from toolkit.train import demo

    monkeypatch.setattr(demo, "sample", lambda hf_dir: "Once a story")
    demo.report(tmp_path)
    out = capsys.readouterr().out
    assert out == "sample: 'Once a story'\n"
