"""The commands the README and the docs/ pages show, exactly as written, from a folder laid out like the
repository's root (its launch.sh and toolkit/ linked in, and a stand-in for the user's model folder and chat rows
the quick start names): each must exit 0. The `dstk` lines run here; a block that launches training (launch.sh,
deepspeed, torchrun) runs whole in the heavy tier. `make`, pytest and bench/gpu.sh lines are not run (they would
set up or test this tree again). Every relative link of those pages must reach a file, and a heading there."""

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


PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
# the quick start's stand-ins: a HF model folder (tiny-llama saved with a ChatML chat template, 4096 positions) and
# chat rows (the shipped ones)
USER_MODEL, USER_DATA = "my-model", "my_chat.jsonl"


def blocks() -> list:
    """("page: heading", [command lines]) for each ```bash block of the README and docs/, comments and blanks
    left out."""
    out = []
    for page in PAGES:
        heading = None
        for match in re.finditer(r"^(#+ [^\n]*)$|^```bash\n(.*?)^```", (REPO / page).read_text(), re.M | re.S):
            if match.group(1):  # the README's title heads its quick start
                title = page == "README.md" and match.group(1).startswith("# ")
                heading = "quick start" if title else match.group(1).lstrip("# ")
                continue
            lines = [line for line in match.group(2).splitlines() if line.strip() and not line.lstrip().startswith("#")]
            out.append((f"{page}: {heading}", lines))
    return out


def first_word(line: str) -> str:
    return shlex.split(line, comments=True)[0]


def runnable(lines: list) -> list:
    return [line for line in lines if not first_word(line).startswith(NOT_RUN)]


STAND_IN = f"""
from pathlib import Path
from toolkit.train import hf
model, tokenizer = hf.builtin_model("tiny-llama", 1234), hf.byte_tokenizer()
model.config.max_position_embeddings = 4096
tokenizer.chat_template = Path({str(REPO / "toolkit" / "corpus" / "chatml.jinja")!r}).read_text()
model.save_pretrained("{USER_MODEL}")
tokenizer.save_pretrained("{USER_MODEL}")
"""


@pytest.fixture(scope="session")
def user_files(tmp_path_factory) -> Path:
    """The quick start's model folder and chat rows, made once per session (in a child: no torch here)."""
    folder = tmp_path_factory.mktemp("user_files")
    done = subprocess.run([sys.executable, "-c", STAND_IN], cwd=folder, capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    (folder / USER_DATA).symlink_to(REPO / "toolkit" / "corpus" / "chat.jsonl")
    return folder


def root_like(tmp_path: Path, user_files: Path) -> Path:
    """A working folder where the pages' relative paths resolve: launch.sh, toolkit/ (its corpus),
    ds_configs/ (a place to write in) with the shipped recipes/, and the user's model folder and chat rows."""
    (tmp_path / "launch.sh").symlink_to(REPO / "launch.sh")
    (tmp_path / "toolkit").symlink_to(REPO / "toolkit")
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "recipes").symlink_to(REPO / "ds_configs" / "recipes")
    for name in (USER_MODEL, USER_DATA):
        (tmp_path / name).symlink_to(user_files / name)
    return tmp_path


def run_lines(lines: list, cwd: Path, timeout: int = 300) -> None:
    env = child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
                    PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for line in lines:
        done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"{line}\n{done.stderr[-3000:]}"


DSTK_BLOCKS = [(h, runnable(lines)) for h, lines in blocks() if runnable(lines)
               and not any(first_word(line) in LAUNCHES for line in lines)]
LAUNCH_BLOCKS = [(h, runnable(lines)) for h, lines in blocks() if any(first_word(line) in LAUNCHES for line in lines)]


def test_the_pages_have_the_blocks_these_tests_run():
    assert [h for h, _ in DSTK_BLOCKS] == ["docs/configs.md: Generate, validate, schema",
                                           "docs/layouts.md: Partition, plan, schedule"]
    assert [h for h, _ in LAUNCH_BLOCKS] == ["README.md: quick start",
                                            "docs/training.md: Train"]


def test_the_quick_start_comes_first_and_fits_a_screen():
    """The README opens with the quick start: at most 40 lines before its first section, with a launch.sh
    fine-tune of a --model folder, and it names the whole-suite command CI runs."""
    text = (REPO / "README.md").read_text()
    head = text[:text.index("\n## ")].splitlines()
    assert len(head) <= 40, f"the quick start is {len(head)} lines"
    assert any(line.startswith("./launch.sh ") and f"--model {USER_MODEL}" in line for line in head)
    assert "make test-all" in text and "make test-all" in (REPO / ".ci" / "run").read_text()


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_reach_a_file_and_a_heading(page):
    text = (REPO / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, fragment = target.partition("#")
        linked = ((REPO / page).parent / path).resolve() if path else REPO / page
        assert linked.exists(), f"{page}: the link {target} reaches no file"
        if fragment:
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            assert fragment in {anchor(h) for h in headings}, f"{page}: the link {target} reaches no heading"


def test_no_page_points_at_the_notes_outside_the_repository():
    for page in PAGES:
        text = (REPO / page).read_text()
        assert "/work/shared" not in text and "../shared" not in text, page


@pytest.mark.parametrize("heading, lines", DSTK_BLOCKS, ids=[h for h, _ in DSTK_BLOCKS])
def test_dstk_commands_run_as_written(tmp_path, user_files, heading, lines):
    run_lines(lines, root_like(tmp_path, user_files))


@pytest.mark.parametrize("heading, lines", LAUNCH_BLOCKS, ids=[h for h, _ in LAUNCH_BLOCKS])
def test_dstk_commands_before_the_first_flags_launch_run_as_written(tmp_path, user_files, heading, lines):
    """A launch block's dstk lines up to its first launch by flags (the config it launches with: `dstk plan
    --emit-config`, or generate-config and partition) run here; a launch by a shipped recipe before them is
    checked by tests/commands/test_recipes.py."""
    first = next(i for i, line in enumerate(lines) if first_word(line) in LAUNCHES and "--recipe" not in line)
    recipes = [line for line in lines[:first] if first_word(line) in LAUNCHES]
    for line in recipes:
        recipe = shlex.split(line)[shlex.split(line).index("--recipe") + 1]
        assert recipe.startswith("ds_configs/recipes/") and (REPO / recipe).is_file(), line
    before = [line for line in runnable(lines[:first]) if first_word(line) not in LAUNCHES]
    assert before and all(first_word(line) == "dstk" for line in before)
    run_lines(before, root_like(tmp_path, user_files))


# what each launch block leaves in its working folder
WRITES = {"README.md: quick start":
          ["runs/full/hf/config.json", "runs/full/hf_bf16/config.json", "runs/lora/adapter/adapter_config.json"],
          "docs/training.md: Train": ["runs/dstk/hf_again/config.json", "runs/full-finetune/recipe.yaml"]}


@pytest.mark.heavy
@pytest.mark.parametrize("heading, lines", LAUNCH_BLOCKS, ids=[h for h, _ in LAUNCH_BLOCKS])
def test_training_block_runs_as_written(tmp_path, user_files, heading, lines):
    """A launch block whole: the quick start (plan, a full and a LoRA fine-tune of the stand-in model folder, an
    export), and the Train page's (a recipe, then config, partition, launch.sh, deepspeed, torchrun, export; 2
    CPU ranks each)."""
    cwd = root_like(tmp_path, user_files)
    run_lines(lines, cwd, timeout=600)
    for path in WRITES[heading]:
        assert (cwd / path).is_file(), path
