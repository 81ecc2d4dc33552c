"""launch.sh with bad counts or a config made for another process count: a usage message and exit 2,
never bash's own errors (arithmetic, unbound variables), and no hostfile left behind."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import launch_sh

REPO = Path(__file__).resolve().parents[2]
BASH_ERRORS = ("syntax error", "unbound variable", "arithmetic", "invalid number", "division by")


def launch(tmp_path, *args):
    """launch.sh with its temporary files (the hostfile) in tmp_path."""
    return launch_sh(*args, env=dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path)), timeout=120)


def config(tmp_path, **cfg):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("args,needle", [
    (["--num-gpus", "0"], "--num-gpus must be a whole number from 1 to 999999, got '0'"),
    (["--num-gpus", "abc"], "--num-gpus must be a whole number from 1 to 999999, got 'abc'"),
    (["--num-gpus", "-2"], "--num-gpus must be a whole number from 1 to 999999, got '-2'"),
    (["--num-gpus", "--dry-run"], "--num-gpus needs a value"),
    (["--num-gpus", "99999999999999999999"], "got '99999999999999999999'"),
    (["--num-gpus"], "--num-gpus needs a value"),
    (["--num-nodes", "x", "--num-gpus", "2"], "--num-nodes must be a whole number"),
    (["--master-port", "70000"], "--master-port must be a whole number from 1 to 65535"),
    (["--num-nodes", "2", "--num-gpus", "1", "--node-rank", "2", "--master-addr", "10.0.0.1"],
     "--node-rank 2 is not below --num-nodes 2"),
])
def test_bad_counts_are_a_usage_message(tmp_path, args, needle):
    cfg = config(tmp_path)
    run = launch(tmp_path, "--config", cfg, "--dry-run", *args)
    assert run.returncode == 2 and needle in run.stderr and run.stdout == "", run.stderr
    assert run.stderr.startswith("launch.sh: ") and not any(e in run.stderr for e in BASH_ERRORS)
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]  # no hostfile


@pytest.mark.parametrize("stages,args,suggestion", [
    (2, ["--num-gpus", "3"], "--num-gpus 3 x 1 node(s) = 3 processes, but {cfg} has pipeline.stages 2, which does "
                             "not divide 3; use --num-gpus 2 or 4"),
    (4, ["--num-gpus", "2"], "use --num-gpus 4,"),
    (2, ["--num-gpus", "1", "--num-nodes", "3", "--node-rank", "0", "--master-addr", "10.0.0.1"],
     "= 3 processes, but {cfg} has pipeline.stages 2, which does not divide 3; use --num-gpus 2,"),
])
def test_stages_that_do_not_divide_the_processes_suggest_num_gpus(tmp_path, stages, args, suggestion):
    cfg = config(tmp_path, pipeline={"stages": stages})
    run = launch(tmp_path, "--config", cfg, "--dry-run", *args)
    assert run.returncode == 2 and suggestion.format(cfg=cfg) in run.stderr, run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]  # checked before the hostfile is written


@pytest.mark.parametrize("cfg", [{"pipeline": {"stages": 2}}, {"pipeline": {"stages": "auto"}}, {}])
def test_fitting_or_unknown_stages_pass(tmp_path, cfg):
    run = launch(tmp_path, "--config", config(tmp_path, **cfg), "--dry-run", "--num-gpus", "4")
    assert run.returncode == 0 and "--num_gpus 4 " in run.stdout, run.stderr


def test_stages_of_a_recipes_inline_config_that_do_not_divide_the_processes(tmp_path):
    import yaml

    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump({"model": "tiny-gpt2", "data": "d.txt", "config": {"pipeline": {"stages": 2}}}))
    run = launch(tmp_path, "--num-gpus", "3", "--dry-run", "--", "--recipe", str(recipe))
    assert run.returncode == 2 and "processes, but the config of --recipe (" in run.stderr, run.stderr
    assert "run.yaml.config.json) has pipeline.stages 2, which does not divide 3; use --num-gpus 2 or 4" in run.stderr
