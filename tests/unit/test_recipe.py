"""`dstk train --recipe FILE` (toolkit.config.recipe): the file's keys are the command's own options, the
command line wins over the file and the file over the defaults, a typo or a bad value is one line naming
the key, the file and the fix; an inline DeepSpeed config goes through the loader like a file's.

Parsing runs through Click's own make_context; refusals and --check through the real entry point in this
process (tests/invoke.py). A recipe that trains and resumes: tests/distributed/test_recipe_run.py; the
shipped recipes and launch.sh: tests/commands/test_recipes.py.
"""

import json
import tempfile
from pathlib import Path

import click
import pytest
import yaml

from tests.configs import ds_config
from tests.unit.test_train_refusals import refused, train_entry
from toolkit.cli.train import COMMAND_LINE_ONLY, train
from toolkit.config.recipe import recipe_option, recorded
from toolkit.errors import UnusableInput

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
CONFIG = ds_config(2, 2, gradient_clipping=0.0)


@pytest.fixture(autouse=True)
def temp_here(tmp_path, monkeypatch):
    """Inline configs are written under the temporary folder: this test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def base(tmp_path, **keys) -> dict:
    return {"model": "tiny-gpt2", "data": str(CORPUS), "out": str(tmp_path / "run"), "config": CONFIG, **keys}


def parsed(*args) -> click.Context:
    return train.make_context("train", [str(a) for a in args])


def test_the_command_line_wins_over_the_file_and_the_file_over_the_defaults(tmp_path):
    recipe = write(tmp_path / "r.yaml", base(tmp_path, steps=2, **{"seq-len": 32}))
    ctx = parsed("--recipe", recipe, "--steps", 5)
    assert (ctx.params["steps"], ctx.params["seq_len"], ctx.params["eval_every"]) == (5, 32, 0)
    saved = yaml.safe_load(recorded(ctx, COMMAND_LINE_ONLY))
    assert saved["steps"] == 5 and saved["seq-len"] == 32 and "eval-every" not in saved  # given ones only
    assert saved["config"] == CONFIG  # an inline config stays inline


@pytest.mark.parametrize("keys, expect", [
    ({"seq_len": 64, "eval-every": 3}, {"seq_len": 64, "eval_every": 3}),  # underscores or dashes
    ({"lora": True, "packing": False, "export": False}, {"lora": True, "packing": False, "export": False}),
    ({"no-export": True, "no_progress": True}, {"export": False, "progress": False}),  # a flag's off switch
    ({"deepspeed_config": "ds.json"}, {"config": "ds.json"}),  # the option's other names
    ({"lora_dropout": "1e-1", "steps": None}, {"lora_dropout": 0.1, "steps": None}),  # converted; null: the default
    ({"report-to": "tensorboard"}, {"report_to": ("tensorboard",)}),  # a repeatable flag: one value or a list
    ({"report_to": ["tensorboard", "wandb"]}, {"report_to": ("tensorboard", "wandb")}),
])
def test_keys_are_the_options_names(tmp_path, keys, expect):
    recipe = base(tmp_path, **keys)
    if "deepspeed_config" in keys:
        del recipe["config"]
    ctx = parsed("--recipe", write(tmp_path / "r.yaml", recipe))
    assert {k: ctx.params[k] for k in expect} == expect


def test_any_option_of_the_command_is_a_key_without_a_list_of_names(tmp_path):
    """An option added to a command (as --report-to would be) is a recipe key at once."""
    @click.command()
    @recipe_option(("dry_run",))
    @click.option("--report-to", type=click.Choice(["none", "tensorboard"]), default="none")
    @click.option("--tags", multiple=True)
    @click.option("--dry-run", is_flag=True)
    def cmd(**kw):
        pass

    recipe = write(tmp_path / "r.yaml", {"report_to": "tensorboard", "tags": ["a", "b"]})
    ctx = cmd.make_context("cmd", ["--recipe", str(recipe)])
    assert ctx.params == {"report_to": "tensorboard", "tags": ("a", "b"), "dry_run": False}
    assert yaml.safe_load(recorded(ctx, ("dry_run",))) == {"report-to": "tensorboard", "tags": ["a", "b"]}
    with pytest.raises(UnusableInput, match=r"unknown key 'report_too'; did you mean --report-to\?"):
        cmd.make_context("cmd", ["--recipe", str(write(tmp_path / "typo.yaml", {"report_too": "none"}))])


def test_a_typo_is_refused_with_the_closest_flag(tmp_path):
    recipe = write(tmp_path / "run.yaml", base(tmp_path, seq_lenn=32))
    result = train_entry(["--recipe", recipe, "--check"])
    refused(result, 2, f"recipe {recipe}: unknown key 'seq_lenn'; did you mean --seq-len?")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("keys, said", [
    ({"seq_len": "long"}, "seq_len: 'long' is not a valid integer range; it takes a whole number >= 1"),
    ({"steps": 0}, "steps: 0 is not in the range x>=1; it takes a whole number >= 1"),
    ({"eval-fraction": 1.5}, "it takes a number >= 0 and < 1"),
    ({"format": "chatml"}, "it takes one of: auto, text, prompt-completion, chat, alpaca, sharegpt"),
    ({"lora": "maybe"}, "lora: 'maybe' is not a valid boolean"),
    ({"model": ["a", "b"]}, "model takes text (DIR|NAME|ORG/NAME), not a list"),
    ({"seq_len": 32, "seq-len": 64}, "seq-len sets --seq-len a second time"),
    ({"overwrite": True}, "overwrite is for the command line only (--overwrite says what one invocation does"),
    ({"check": True}, "pass --check with --recipe"),
    ({"config": {"lr": float("nan")}}, "config: the inline DeepSpeed config has a value JSON cannot hold"),
])
def test_a_bad_value_names_the_key_and_what_it_takes(tmp_path, keys, said):
    recipe = write(tmp_path / "run.yaml", base(tmp_path, **keys))
    refused(train_entry(["--recipe", recipe, "--check"]), 2, f"recipe {recipe}: ", said)


@pytest.mark.parametrize("text, said", [
    (None, "no such file"), ("model: [a\n", "not readable YAML (line 2)"), ("- model\n", "holds a list"),
    ("steps: 2\nconfig: {gradient_clipping: 1.0}\nsteps: 3\n", "not readable YAML (line 3): 'steps' is given twice"),
])
def test_an_unreadable_recipe_is_one_line(tmp_path, text, said):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    refused(train_entry(["--recipe", path, "--check"]), 2, said)


def test_an_inline_config_goes_through_the_loader_and_the_messages_name_it(tmp_path):
    good = write(tmp_path / "run.yaml", base(tmp_path))
    result = train_entry(["--recipe", good, "--check", "--world-size", "2"])
    assert result.returncode == 0 and f"ok: {good}'s inline config (" in result.stdout, result.stderr
    bad = write(tmp_path / "bad.yaml", base(tmp_path, config={**CONFIG, "train_batch_size": 3}))
    result = train_entry(["--recipe", bad, "--check", "--world-size", "2"])
    refused(result, 1, "bad.yaml.config.json is refused for training on 2 process(es)", '"train_batch_size" 3')
    written = Path(result.stderr.split("error: ")[1].split(" is refused")[0])
    assert written.is_relative_to(tmp_path / "tmp") and written.name == "bad.yaml.config.json"
    assert json.loads(written.read_text()) == {**CONFIG, "train_batch_size": 3}  # `dstk validate FILE` reads it


def test_a_config_flag_wins_over_the_inline_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    recipe = write(tmp_path / "run.yaml", base(tmp_path, config={"train_batch_size": "not a number"}))
    result = train_entry(["--recipe", recipe, "--config", path, "--check"])
    assert result.returncode == 0 and f"ok: {path}, " in result.stdout, result.stderr
    saved = recorded(parsed("--recipe", recipe, "--config", path), COMMAND_LINE_ONLY)
    path.unlink()  # the saved recipe holds the config the run read, inline: it continues the run without the file
    assert yaml.safe_load(saved)["config"] == CONFIG


def test_relative_paths_are_read_from_the_current_directory(tmp_path):
    """As on the command line (and as launch.sh's check reads them), not from the recipe's folder."""
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    (tmp_path / "recipes").mkdir()
    recipe = write(tmp_path / "recipes" / "run.yaml", base(tmp_path, config="ds.json", out="run"))
    from tests.invoke import invoke_dstk

    result = invoke_dstk(["train", "--recipe", "recipes/run.yaml", "--check"], cwd=tmp_path)
    assert result.returncode == 0 and "ok: ds.json, " in result.stdout, result.stderr
    assert recipe.exists()


def test_the_saved_recipe_reads_back_as_the_same_flags_without_the_command_line_only_ones(tmp_path):
    recipe = write(tmp_path / "run.yaml", base(tmp_path, lora=True, **{"no-export": True, "lora-r": 4}))
    ctx = parsed("--recipe", recipe, "--steps", 3, "--overwrite", "--check", "--world-size", 2)
    text = recorded(ctx, COMMAND_LINE_ONLY, "# header\n")
    assert text.startswith("# header\n")
    saved = yaml.safe_load(text)
    assert not {"overwrite", "check", "world-size", "resume"} & set(saved)
    (tmp_path / "saved").mkdir()  # the same name and content: the same inline config file
    again = parsed("--recipe", write(tmp_path / "saved" / "run.yaml", saved), "--resume")
    assert {k: v for k, v in again.params.items() if k not in COMMAND_LINE_ONLY} == \
           {k: v for k, v in ctx.params.items() if k not in COMMAND_LINE_ONLY}


# values as a user writes them, the same text in a recipe and after a flag
TYPED = ["2.7", "3", "0", "-2", "1e-4", "0.5", "7.0", "true", "false", "x", "1e3", "2024-01-01"]


def outcome(make):
    try:
        ctx = make()
    except (click.ClickException, UnusableInput):
        return "refused"
    return ctx


def recipe_options():
    from toolkit.config.recipe import recipe_keys

    found = {p.name: p for p, _ in recipe_keys(train, COMMAND_LINE_ONLY).values()}
    return [found[name] for name in sorted(found)]


def typed(param, flag: str, text: str):
    """What a user types on the command line for `text`: after the flag; a flag's true or false as the flag or its
    off switch (or nothing); None where nothing can say it (a flag takes no value)."""
    if not param.is_flag:
        return [f"--{flag}", text]
    return [param.opts[0]] if text == "true" else list(param.secondary_opts[:1]) if text == "false" else None


@pytest.mark.parametrize("param", recipe_options(), ids=lambda p: p.name)
def test_a_recipe_value_passes_the_options_own_type_as_the_command_line_would(tmp_path, param):
    """Every option: what a recipe's value becomes is what the same text after the flag becomes, refused where that
    is (`steps: 2.7` ran 2 steps and saved `steps: 2`, where `--steps 2.7` is refused). A flag takes true or false."""
    from toolkit.config.recipe import long_name

    flag = long_name(param)
    required = write(tmp_path / "required.yaml", base(tmp_path))
    plain = {k: v for k, v in base(tmp_path).items() if k != param.name}
    for text in ["true", "false", "2.7"] if param.is_flag else TYPED:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump(plain, sort_keys=False) + f"{flag}: {text}\n")
        from_recipe = outcome(lambda: parsed("--recipe", recipe))
        line = typed(param, flag, text)
        from_line = "refused" if line is None else outcome(lambda: parsed("--recipe", required, *line))
        got = from_recipe if from_recipe == "refused" else from_recipe.params[param.name]
        want = from_line if from_line == "refused" else from_line.params[param.name]
        assert got == want, (flag, text, got, want)
