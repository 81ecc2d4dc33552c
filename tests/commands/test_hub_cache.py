"""Hub ids in fresh `dstk` processes, offline from a cache the test lays out (tests/unit/test_hub.py): read
as from_pretrained reads them (HF_HUB_CACHE, HF_HUB_OFFLINE at import), with no torch, deepspeed or
transformers for the commands that only check or plan, and a missing id refused at once in one line."""

import subprocess
import sys
import time

import pytest

from tests.conftest import child_env, run_cli_fresh
from tests.unit.test_hub import REPO_ID, tiny_llama_cache
from tests.unit.test_train_refusals import CORPUS, train_config


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return {"HF_HUB_CACHE": str(tiny_llama_cache(tmp_path_factory.mktemp("hf"))), "HF_HUB_OFFLINE": "1"}


def train_check(tmp_path, model, *args):
    return ["train", "--check", "--model", model, "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
            "--out", str(tmp_path / "run"), "--seq-len", "32", *args]


def test_train_check_passes_from_the_cache_without_deepspeed_or_transformers(env, tmp_path):
    """torch comes in with the folder's safetensors check (models/weights/source.py imports it), as for --model DIR."""
    result, heavy = run_cli_fresh(train_check(tmp_path, REPO_ID, "--revision", "v2"), env)
    assert result.returncode == 0 and "fit to train" in result.stdout, result.stderr[-2000:]
    assert "deepspeed" not in heavy and "transformers" not in heavy, heavy


def test_an_id_missing_offline_is_refused_at_once_in_one_line(env, tmp_path):
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "toolkit.train", *train_check(tmp_path, "dstk-test/absent")[1:]],
                            capture_output=True, text=True, timeout=120, env={**child_env(), **env})
    assert time.monotonic() - start < 20  # a fresh interpreter on 2 busy cores; no hub retries (50 s and more)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line] == [result.stderr.strip()]  # one line
    for words in ("error: --model dstk-test/absent", env["HF_HUB_CACHE"], "at revision main",
                  "`hf download dstk-test/absent --revision main`"):
        assert words in result.stderr, result.stderr


@pytest.mark.parametrize("argv", [["partition", REPO_ID, "--pp", "2"],
                                  ["plan", "--model", REPO_ID, "--gbs", "8", "--gpu", "a100-80gb", "--gpus", "2"]])
def test_partition_and_plan_read_the_cached_config_and_import_no_heavy_package(env, argv):
    result, heavy = run_cli_fresh(argv, env)
    assert result.returncode == 0 and REPO_ID in result.stdout, result.stderr[-2000:]
    assert heavy == []
