"""A run on a machine without matplotlib (the GPU image of issue 43 may lack it): rank 0 skips loss.png after
training and says so; the run still writes summary.json and exits 0."""

import json

import pytest

from tests.configs import QUIET, ds_config, write_config
from tests.distributed.launch import COMMON
from tests.ranks import run_ranks

pytestmark = pytest.mark.distributed

NO_MATPLOTLIB = """
import runpy, sys
sys.modules["matplotlib"] = None  # `import matplotlib` raises ImportError (the warm server had imported it)
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
"""


def test_a_run_without_matplotlib_skips_loss_png_and_still_succeeds(tmp_path):
    script = tmp_path / "no_matplotlib.py"
    script.write_text(NO_MATPLOTLIB)
    cfg = write_config(tmp_path / "ds.json", ds_config(2, 1, **QUIET))
    out = tmp_path / "run"
    rc, log = run_ranks([script, "--config", cfg, *COMMON, "--steps", "2", "--no-export", "--eval-fraction", "0",
                         "--out", out], 1, timeout=120)
    assert rc == 0, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loss_png"] is None and summary["loss_png_skipped"].startswith("matplotlib is not importable")
    assert not (out / "loss.png").exists()
    assert "loss curve: skipped: matplotlib is not importable (ModuleNotFoundError: " in log
