"""A run from a hub id on forked ranks (tests/ranks.py), offline from a cache laid out as huggingface_hub lays
it out (tests/unit/test_hub.py): launch.sh's `--check` reads the snapshot folder from the cache alone, then
local rank 0 resolves the id while the other rank waits (toolkit.distributed.process_group.once_per_node),
every rank trains from the same folder (a pipeline stage each, reading its own tensors), and the manifest
records the folder, so a resume compares folders whichever way the model was named."""

import json

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import CORPUS
from tests.ranks import run_ranks, run_train
from tests.unit.test_hub import LAYERS, REPO_ID, snapshot_dir, tiny_llama_cache

pytestmark = pytest.mark.distributed


def test_a_run_from_a_hub_id_trains_from_its_snapshot_and_resumes_by_folder(tmp_path):
    cache = tiny_llama_cache(tmp_path / "hf")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cfg = write_config(tmp_path / "ds.json", run_config(mbs=2, gas=2, pp=2))
    out = tmp_path / "run"
    common = ["--config", cfg, "--data", CORPUS, "--seq-len", "32", "--no-progress", "--eval-fraction", "0.01",
              "--out", out]
    rc, log = run_train([*common, "--model", REPO_ID, "--revision", "v2", "--steps", "2", "--no-export"], 2, env=env)
    assert rc == 0, log[-3000:]
    folder = snapshot_dir(cache, "v2")
    assert f"model: {REPO_ID}, weights from {folder}" in log, log[-3000:]
    assert "step    loss" in log and "\n   2   " in log, log  # the loss table's last step
    record = json.loads((out / "checkpoints" / "dstk" / "manifest.json").read_text())
    assert record["model"] == folder and record["hub"] == {"--model": REPO_ID, "--revision": "v2"}
    assert len(record["hf_names"]) == LAYERS["v2"] + 3  # pipeline layers: embedding, blocks, norm, head

    def resume_check(*model):
        return run_ranks(["-m", "toolkit.train", "--check", "--world-size", "2", *common, *model, "--resume"], 1, env)

    rc, log = resume_check("--model", folder)  # the same snapshot, named by its folder
    assert rc == 0, log[-3000:]
    rc, log = resume_check("--model", REPO_ID)  # main: another commit
    assert rc == 1 and "was written by another run (model: checkpoint" in log and snapshot_dir(cache, "main") in log
