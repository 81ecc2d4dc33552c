"""`dstk schema -o` and `dstk schedule --png`: an output path that cannot be written is one clean
message (no traceback, nothing left behind); an existing schema file is replaced only with --force;
`schedule` takes --gas like every other command (--micro-batches/-m still work, hidden)."""

import importlib.util
import json

import pytest

from tests.invoke import dstk
from toolkit.config.schema import load_schema


def test_schema_into_a_missing_folder_is_refused(tmp_path):
    result = dstk("schema", "-o", "missing/dir/x.json", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: cannot write -o missing/dir/x.json: directory")
    assert "mkdir -p" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_schema_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "ds.schema.json"
    out.write_text("keep me")
    result = dstk("schema", "-o", str(out))
    assert result.returncode == 1 and "--force" in result.stderr and "Traceback" not in result.stderr
    assert out.read_text() == "keep me"
    assert dstk("schema", "-o", str(out), "--force").returncode == 0
    assert json.loads(out.read_text()) == load_schema()
    assert [p.name for p in tmp_path.iterdir()] == ["ds.schema.json"]  # no temp file left


@pytest.mark.parametrize("png,needle", [
    ("missing/dir/s.png", "--png missing/dir/s.png: directory"),
    ("x.txt", "--png x.txt: the file name must end in .png"),
])
def test_schedule_png_path_is_checked_first(tmp_path, png, needle):
    result = dstk("schedule", "--pp", "2", "--gas", "2", "--png", png, cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr and needle in result.stderr, result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_schedule_png_leaves_only_the_png(tmp_path):
    result = dstk("schedule", "--pp", "2", "--gas", "3", "--png", "s.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"] and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_schedule_takes_gas_and_keeps_the_old_names_hidden():
    new = dstk("schedule", "--pp", "2", "--gas", "3")
    assert new.returncode == 0 and "bubble: 25.0%" in new.stdout
    assert dstk("schedule", "--pp", "2", "--micro-batches", "3").stdout == new.stdout
    assert dstk("schedule", "--pp", "2", "-m", "3").stdout == new.stdout
    help_text = dstk("schedule", "--help").stdout
    assert "--gas" in help_text and "--micro-batches" not in help_text and "-m," not in help_text


@pytest.mark.parametrize("args,code,needle", [
    (["--pp", "2"], 2, "Missing option '--gas'"),
    (["--pp", "2", "--gas", "3", "-m", "4"], 2, "--gas 3 and --micro-batches 4 disagree"),
    (["--pp", "2", "--gas", "0"], 1, "--gas/--micro-batches must be a positive integer, got 0"),
    (["--pp", "100000", "--gas", "8"], 1, "slots, more than a picture can show"),
])
def test_schedule_bad_sizes(args, code, needle):
    result = dstk("schedule", *args)
    assert result.returncode == code and needle in result.stderr and "Traceback" not in result.stderr, result.stderr
