"""A full disk wherever dstk writes (a checkpoint, an export, the data cache) is one line naming the folder, the
space free and what is safe (toolkit.files.full_disk_is_one_line), never torch's `basic_ios::clear` or an OSError
traceback. The disk is a real one that fills: a small tmpfs mounted for the test (tests/conftest.py small_disk: root
only, skipped elsewhere). Through real ranks: tests/distributed/test_rank_agreement.py."""

import pytest

from tests.unit.test_train_refusals import _args, refused
from toolkit.errors import DiskFull


def test_a_checkpoint_that_does_not_fit_names_the_last_whole_one(ds_world1, tmp_path, small_disk):
    """tiny-gpt2 (~2 MB a checkpoint) saving every 2 steps onto a 5 MB disk: a later checkpoint does not fit."""
    import re

    from toolkit.train.runner import run

    out = small_disk(5 * 2**20) / "run"
    with pytest.raises(DiskFull) as info:
        run(_args(tmp_path, out=str(out), steps=10, save_every=2, eval_fraction=0.0))
    message = str(info.value)
    failed = int(re.search(r"while saving checkpoint global_step(\d+)", message).group(1))
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert failed > 2 and latest == f"global_step{failed - 2}", message  # the one before it is whole, and named
    for words in (f"no space left on the device of {out / 'checkpoints'}", "MiB free",
                  f"the last whole checkpoint is {out / 'checkpoints' / latest}", "--resume", f"dstk export {out}"):
        assert words in message, message


def test_an_export_that_does_not_fit_leaves_no_half_written_folder(ds_world1, tmp_path, small_disk):
    from tests.invoke import invoke_dstk
    from toolkit.train.runner import run

    run(_args(tmp_path, steps=1, eval_fraction=0.0))
    disk = small_disk(300 * 2**10)
    result = invoke_dstk(["export", str(tmp_path / "run"), str(disk / "hf")])
    refused(result, 2, f"while writing the export {disk / 'hf'}", "the checkpoint is whole",
            f"`dstk export {tmp_path / 'run'}")
    assert not any(disk.iterdir())  # the temporary folder beside it is gone too
