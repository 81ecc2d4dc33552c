"""Each shipped recipe (ds_configs/recipes/) passes the check launch.sh makes before any rank starts,
`python -m toolkit.train --recipe FILE --check --world-size N`, in a fresh process from the repository's
root, N read from the launch command its header gives."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "ds_configs" / "recipes").glob("*.yaml"))


def test_the_common_jobs_are_shipped():
    assert [p.name for p in RECIPES] == ["3d.yaml", "dpo_lora.yaml", "full_finetune.yaml", "lora_chat_sft.yaml", "pretrain_pp_dp.yaml"]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_shipped_recipe_passes_check_as_its_header_launches_it(tmp_path, recipe):
    rel = recipe.relative_to(REPO)
    launch = re.search(rf"^#   \./launch\.sh --num-gpus (\d+) -- --recipe {re.escape(str(rel))}\b", recipe.read_text(), re.M)
    assert launch, f"{rel}: its header gives no `./launch.sh --num-gpus N -- --recipe {rel}` line"
    world = launch.group(1)
    done = subprocess.run([sys.executable, "-m", "toolkit.train", "--recipe", str(rel), "--check", "--world-size", world,
                           "--out", str(tmp_path / "run")],  # not the recipe's runs/...: it may hold a real run
                          cwd=REPO, env=child_env(PYTHONPATH=str(REPO), TMPDIR=str(tmp_path)), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok: ") and f"fit to train on {world} process(es)" in done.stdout
