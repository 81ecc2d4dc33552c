"""Files and folders dstk writes through temporary names get the user's umask, not mkstemp's 0600."""

import os
import stat

import pytest


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_configs_and_partition_rewrites_follow_the_umask(tmp_path, umask_027):
    from toolkit.config.generate import record_partition, write_config

    path = tmp_path / "ds.json"
    write_config({"train_batch_size": 8, "pipeline": {"stages": 2}}, str(path))
    assert _mode(path) == 0o640
    os.chmod(path, 0o600)
    record_partition(str(path), 2, "compute", [0, 3, 6])
    assert _mode(path) == 0o640


def test_an_export_folder_follows_the_umask(tmp_path, umask_027):
    from toolkit.export.directory import write_dir_atomically

    out = tmp_path / "hf"
    write_dir_atomically(out, lambda d: (d / "config.json").write_text("{}"))
    assert _mode(out) == 0o750 and _mode(out / "config.json") == 0o640
