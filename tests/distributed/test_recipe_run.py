"""A run from a recipe (`dstk train --recipe FILE`) trains with the command line's flags over the file's,
saves what it used as OUT/recipe.yaml (the inline DeepSpeed config inline), and `--recipe OUT/recipe.yaml
--resume --steps N` continues that run: the resume checks (same token stream, model, layout) accept it.
One rank forked from the warm rank server (tests/ranks.py), launch.sh's check first; tiny-gpt2, 3 + 2 steps.
The recipe's keys and refusals: tests/unit/test_recipe.py."""

import pytest
import yaml

from tests.configs import QUIET, ds_config
from tests.distributed.launch import CORPUS
from tests.distributed.test_train import losses
from tests.ranks import run_train

pytestmark = pytest.mark.distributed

CONFIG = ds_config(2, 1, gradient_clipping=0.0, **QUIET)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The recipe says steps 2; the command line says --steps 3. Returns (run folder, log)."""
    tmp = tmp_path_factory.mktemp("recipe")
    recipe = tmp / "run.yaml"
    recipe.write_text(yaml.safe_dump({"model": "tiny-gpt2", "data": str(CORPUS), "seq_len": 32, "steps": 2,
                                      "no-progress": True, "export": False, "out": str(tmp / "run"), "config": CONFIG}))
    rc, log = run_train(["--recipe", recipe, "--steps", "3"], 1, env={"TMPDIR": str(tmp)})
    assert rc == 0, log[-3000:]
    return tmp / "run", log


def test_a_flag_wins_over_the_recipe_in_the_run_and_in_its_saved_recipe(first_run):
    out, log = first_run
    assert sorted(losses(out)) == [1, 2, 3] and "fresh run: steps 1..3" in log
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved == {"model": "tiny-gpt2", "data": str(CORPUS), "out": str(out), "seq-len": 32, "steps": 3,
                     "export": False, "progress": False, "config": CONFIG}


def test_the_saved_recipe_resumes_the_run(first_run):
    out, _ = first_run
    rc, log = run_train(["--recipe", out / "recipe.yaml", "--resume", "--steps", "5"], 1, env={"TMPDIR": str(out.parent)})
    assert rc == 0, log[-3000:]
    assert "resume: from global_step3 (step 3)" in log and "steps 4..5" in log
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved["steps"] == 5 and "resume" not in saved and saved["config"] == CONFIG
