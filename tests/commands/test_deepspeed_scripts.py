"""DeepSpeed's own scripts, run as a user runs them (python -m, a process of their own), on what dstk
writes: ds_to_universal converts a dstk checkpoint. dstk reshard itself: tests/unit/test_reshard.py."""

import subprocess
import sys

import torch

from tests.unit.test_launch import _args
from toolkit.checkpoint import portable


def test_deepspeeds_universal_converter_reads_a_dstk_checkpoint(ds_world1, tmp_path):
    """dstk writes the universal_checkpoint_info DeepSpeed's ds_to_universal needs (ZeRO-1/2, bf16): the
    converter runs on a dstk checkpoint and its per-parameter moments are dstk's, by name."""
    from toolkit.train.runner import run

    run(_args(tmp_path, 1, steps=2, export=False, eval_fraction=0))
    tag = tmp_path / "run" / "checkpoints" / "global_step2"
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                           "--output_folder", str(tmp_path / "universal"), "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = portable.read(tmp_path / "run" / "checkpoints")
    name = "transformer.h.0.attn.c_attn.weight"
    theirs = torch.load(tmp_path / "universal" / "zero" / name / "exp_avg.pt", weights_only=False)["param"]
    assert torch.equal(theirs.reshape(-1), ours.moments["exp_avg"][name].reshape(-1))
