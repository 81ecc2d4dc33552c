"""The README's commands, exactly as written, from a folder laid out like the repository's root (its
launch.sh and toolkit/ linked in): each must exit 0. The `dstk` lines run here; a block that launches
training (launch.sh, deepspeed, torchrun) runs whole in the heavy tier. `make`, pytest and bench/gpu.sh
lines are not run (they would set up or test this tree again)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]
LAUNCHES = ("./launch.sh", "deepspeed", "torchrun")
NOT_RUN = ("make", "bench/gpu.sh", ".venv/bin/python")


def blocks() -> list:
    """(heading, [command lines]) for each ```bash block of the README, comments and blanks left out."""
    out, heading = [], None
    for match in re.finditer(r"^(#+ [^\n]*)$|^```bash\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ")
            continue
        lines = [line for line in match.group(2).splitlines() if line.strip() and not line.lstrip().startswith("#")]
        out.append((heading, lines))
    return out


def first_word(line: str) -> str:
    return shlex.split(line, comments=True)[0]


def runnable(lines: list) -> list:
    return [line for line in lines if not first_word(line).startswith(NOT_RUN)]


def root_like(tmp_path: Path) -> Path:
    """A working folder where the README's relative paths resolve: launch.sh, toolkit/ (its corpus),
    ds_configs/ (a place to write in) with the shipped recipes/."""
    (tmp_path / "launch.sh").symlink_to(REPO / "launch.sh")
    (tmp_path / "toolkit").symlink_to(REPO / "toolkit")
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "recipes").symlink_to(REPO / "ds_configs" / "recipes")
    return tmp_path


def run_lines(lines: list, cwd: Path, timeout: int = 300) -> None:
    env = child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
                    PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for line in lines:
        done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"README: {line}\nexit {done.returncode}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"README: {line}\n{done.stderr[-3000:]}"


DSTK_BLOCKS = [(h, runnable(lines)) for h, lines in blocks() if runnable(lines)
               and not any(first_word(line) in LAUNCHES for line in lines)]
LAUNCH_BLOCKS = [(h, runnable(lines)) for h, lines in blocks() if any(first_word(line) in LAUNCHES for line in lines)]


def test_the_readme_has_the_blocks_these_tests_run():
    assert [h for h, _ in DSTK_BLOCKS] == ["Configs", "Partition, plan, schedule"]
    assert [h for h, _ in LAUNCH_BLOCKS] == ["Train"]


@pytest.mark.parametrize("heading, lines", DSTK_BLOCKS, ids=[h for h, _ in DSTK_BLOCKS])
def test_readme_dstk_commands_run_as_written(tmp_path, heading, lines):
    run_lines(lines, root_like(tmp_path))


@pytest.mark.parametrize("heading, lines", LAUNCH_BLOCKS, ids=[h for h, _ in LAUNCH_BLOCKS])
def test_readme_dstk_commands_before_the_first_flags_launch_run_as_written(tmp_path, heading, lines):
    """The block opens with a shipped recipe (each passes --check: tests/commands/test_recipes.py), then the
    dstk lines that make the config the flags form launches with: those run here."""
    recipe = shlex.split(lines[0])[shlex.split(lines[0]).index("--recipe") + 1]
    assert first_word(lines[0]) == "./launch.sh" and (REPO / recipe).is_file() and recipe.startswith("ds_configs/recipes/")
    rest = lines[1:]
    before = rest[:next(i for i, line in enumerate(rest) if first_word(line) in LAUNCHES)]
    assert before and all(first_word(line) == "dstk" for line in before)
    run_lines(before, root_like(tmp_path))


@pytest.mark.heavy
@pytest.mark.parametrize("heading, lines", LAUNCH_BLOCKS, ids=[h for h, _ in LAUNCH_BLOCKS])
def test_readme_training_block_runs_as_written(tmp_path, heading, lines):
    """The Train block whole: a recipe, then config, partition, launch.sh, deepspeed, torchrun (2 CPU ranks
    each), export."""
    cwd = root_like(tmp_path)
    run_lines(lines, cwd, timeout=600)
    assert (cwd / "runs" / "dstk" / "hf_again" / "config.json").is_file()
    assert (cwd / "runs" / "full-finetune" / "recipe.yaml").is_file()
