"""A downloaded run whose checkpoint holds a planted pickle (a __reduce__ that runs `touch MARKER`) in a model
states file, an optimizer partition file, an RNG file or a pipeline layer file: `dstk export`, `dstk reshard`,
`dstk train --check --resume` and `dstk train --resume` refuse it in one line naming the file and the class, and
its code never runs; with --trust-checkpoint it loads as before (the code runs) and the run says so."""

import os
import shutil

import pytest
import torch

from tests.distributed.launch import COMMON, launch
from tests.invoke import invoke_dstk

TAG = "global_step10"  # train_runs' pp2dp1: 10 steps, pp 2, ZeRO-0, fp32
FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_state_1.pt",
         "layer_01-model_states.pt")  # the optimizer partition is written beside the tag's files (ZeRO-0 has none)


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def planted_run(train_runs, tmp_path, name: str):
    """A copy of the pp2dp1 run with a Planted object in file `name` of its tag (its files' record rewritten,
    as whoever tampered with it would), and the marker the object would create."""
    from toolkit.checkpoint.manifest import write_file_list

    out, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(train_runs.get("pp2dp1"), out)
    path = out / "checkpoints" / TAG / name
    saved = torch.load(path, weights_only=False) if path.exists() else {}
    torch.save({**saved, "planted": Planted(marker)}, path)
    write_file_list(out / "checkpoints" / TAG)
    return out, marker


def refused(output: str, name: str) -> bool:
    """The refusal is the output's last line, it names the file, the class and the way on, and no traceback."""
    line = output.strip().splitlines()[-1]
    return f"{name} holds posix.system" in line and "--trust-checkpoint" in line and "Traceback" not in output


@pytest.mark.parametrize("name", FILES)
def test_export_reshard_and_check_refuse_a_planted_file_and_never_run_it(train_runs, tmp_path, name):
    out, marker = planted_run(train_runs, tmp_path, name)
    config = str(train_runs.folder / "pp2dp1.json")
    for args in (["export", str(out), str(tmp_path / "hf")], ["reshard", str(out), str(tmp_path / "moved"), "--pp", "1"],
                 ["train", "--check", "--resume", "--config", config, *map(str, COMMON), "--out", str(out)]):
        ran = invoke_dstk(args)
        assert ran.returncode != 0 and refused(ran.stderr, name), (args, ran)
        assert not marker.exists(), args
    assert not (tmp_path / "hf").exists() and not (tmp_path / "moved").exists()


def test_resume_refuses_a_planted_layer_file_on_every_rank_and_never_runs_it(train_runs, tmp_path):
    """Refused by launch.sh's check, and by the ranks themselves when they are started without it (deepspeed's
    launcher, torchrun), before DeepSpeed loads the tag."""
    from tests.ranks import run_ranks

    out, marker = planted_run(train_runs, tmp_path, "layer_01-model_states.pt")
    args = ["--config", train_runs.folder / "pp2dp1.json", *COMMON, "--out", out, "--steps", 12, "--resume", "--no-export"]
    rc, log = launch(train_runs.folder / "pp2dp1.json", out, 2, "--steps", 12, "--resume", "--no-export")
    assert rc != 0 and refused(log, "layer_01-model_states.pt"), log[-3000:]
    rc, log = run_ranks(["-m", "toolkit.train", *args], 2)
    assert rc != 0 and refused(log, "layer_01-model_states.pt"), log[-3000:]
    assert not marker.exists()


def test_trust_checkpoint_loads_as_before_and_says_so(train_runs, tmp_path):
    out, marker = planted_run(train_runs, tmp_path, "mp_rank_00_model_states.pt")
    ran = invoke_dstk(["export", str(out), str(tmp_path / "hf"), "--trust-checkpoint"])
    assert ran.returncode == 0 and "--trust-checkpoint" in ran.stderr and marker.exists(), ran
    marker.unlink()
    rc, log = launch(train_runs.folder / "pp2dp1.json", out, 2, "--steps", 12, "--resume", "--no-export",
                     "--trust-checkpoint")
    assert rc == 0 and marker.exists(), log[-3000:]
    assert "note: --trust-checkpoint: the checkpoint's .pt files were loaded as pickles" in log, log[-3000:]
