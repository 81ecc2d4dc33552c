"""One-file recipes for a Click command (`dstk train --recipe run.yaml`): a YAML mapping of its flags.

    model: tiny-llama
    data: toolkit/corpus/corpus.txt
    seq_len: 256          # or seq-len: the flag's name, dashes or underscores
    lora: true            # a flag: true or false (no-export: true is --no-export)
    config:               # a DeepSpeed config file's path, or the config itself
      train_micro_batch_size_per_gpu: 2

Nothing here lists the flags: every visible option of the command is a key, so an option added to it
is one too. The file's values go to Click as the command's default_map, so a flag on the command line
wins over the file and the file over the flags' defaults; each value is converted by the option's own
type here first, so a bad one is refused naming the key and the file. Relative paths are read from the
current directory, as on the command line. An inline config is written as JSON to a file named after
the recipe and its content (every rank writes the same bytes), which the command reads like any
--config. `recorded` gives back what a run used, as a recipe: the run saves it as OUT/recipe.yaml.
"""

import difflib
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import click
from click.core import ParameterSource

from toolkit.errors import UnusableInput

CONFIG = "config"  # the option whose recipe value may be a mapping: the DeepSpeed config itself
MAX_BYTES = 1024**2  # a recipe is a few dozen lines
META = "dstk.recipe"  # ctx.meta key: the Recipe read for this invocation


class Recipe:
    """The file --recipe named: its path and, when its config is inline, that mapping and where it is written."""

    def __init__(self, path: str, inline: dict | None = None):
        self.path = path
        self.inline = inline
        self.inline_file = inline_config_path(path, inline) if inline is not None else None


def recipe_option(command_line_only: tuple = ()):
    """The --recipe option. `command_line_only`: parameter names a recipe may not hold (what one
    invocation does, such as --check or --resume, rather than what the run is); hidden options neither."""
    def load(ctx, param, value):
        if value is not None:
            read_into(ctx, value, command_line_only)

    return click.option("--recipe", metavar="YAML", is_eager=True, expose_value=False, callback=load,
                        help="A YAML file of these flags (keys: flag names, dashes or underscores; `config`: a "
                             "DeepSpeed config path or the config itself, inline). Flags given here win over it; "
                             "relative paths in it are read from the current directory. Every run saves what it "
                             "used as OUT/recipe.yaml: `--recipe OUT/recipe.yaml --resume` continues it.")


def read_into(ctx: click.Context, path: str, command_line_only: tuple) -> None:
    """Check the recipe's keys and values against ctx.command's options; make them the command's defaults."""
    keys = recipe_keys(ctx.command, command_line_only)
    given, inline = {}, None
    for key, value in read_mapping(path).items():
        param, negated = match_key(ctx.command, keys, command_line_only, key, path)
        if param.name in given:
            raise UnusableInput(f"recipe {path}: {key} sets --{long_name(param)} a second time; keep one of them")
        if value is None:
            continue  # `steps:` with nothing: the flag's default
        if param.name == CONFIG and isinstance(value, dict):
            inline = value
            continue
        given[param.name] = convert(ctx, param, key, value, path, negated)
    recipe = Recipe(path, inline)
    if inline is not None:
        given[CONFIG] = str(recipe.inline_file)
    ctx.default_map = {**(ctx.default_map or {}), **given}
    ctx.meta[META] = recipe


def recipe_keys(command: click.Command, command_line_only: tuple) -> dict:
    """key -> (option, negated) for every visible option but `command_line_only`."""
    keys = {}
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden and param.expose_value \
                and param.name not in command_line_only:
            keys.update({key: (param, negated) for key, negated in spellings(param).items() if key not in keys})
    return keys


def spellings(param: click.Option) -> dict:
    """key -> negated: the option's long names without their dashes, with dashes or underscores, and its
    parameter name; a boolean's off switch (no-export) is the option negated."""
    keys = {}
    for names, negated in ((param.opts, False), (param.secondary_opts, True)):
        for bare in (opt[2:] for opt in names if opt.startswith("--")):
            keys.update(dict.fromkeys((bare, bare.replace("-", "_"), bare.replace("_", "-")), negated))
    return {param.name: False, **keys}


def match_key(command, keys: dict, command_line_only: tuple, key, path: str):
    """(option, negated) for a recipe key, else the refusal naming the closest flag."""
    if isinstance(key, str) and key in keys:
        return keys[key]
    for param in command.params:
        if param.name in command_line_only and key in spellings(param):
            raise UnusableInput(f"recipe {path}: {key} is for the command line only (--{long_name(param)} says what "
                                "one invocation does, not what the run is): drop it from the recipe and pass "
                                f"--{long_name(param)} with --recipe")
    close = difflib.get_close_matches(str(key), list(keys), n=1, cutoff=0.6)
    hint = f"; did you mean --{long_name(keys[close[0]][0])}?" if close else ""
    raise UnusableInput(f"recipe {path}: unknown key {key!r}{hint} (keys are the flags of `dstk {command.name} --help`)")


def convert(ctx, param: click.Option, key: str, value, path: str, negated: bool):
    """The value (its text as written: read_mapping) as the option's own type converts it from the command line, or
    a refusal naming the key and what it takes."""
    if param.multiple and not isinstance(value, (list, tuple)):
        value = [value]  # `report-to: tensorboard` is a list of one
    if isinstance(value, (dict, list)) and not (param.multiple or param.nargs != 1):
        raise UnusableInput(f"recipe {path}: {key} takes {what_it_takes(param)}, not a {type(value).__name__}")
    try:
        converted = param.type_cast_value(ctx, value)
    except click.BadParameter as exc:
        raise UnusableInput(f"recipe {path}: {key}: {exc.message.rstrip('.')}; it takes {what_it_takes(param)}") from None
    return not converted if negated else converted


def what_it_takes(param: click.Option) -> str:
    """'true or false', 'one of: a, b', 'a whole number >= 1', ... from the option's type."""
    if param.is_flag or param.is_bool_flag:
        return "true or false"
    if isinstance(param.type, click.Choice):
        return "one of: " + ", ".join(map(str, param.type.choices))
    info = param.type.to_info_dict()
    kind = {"INT": "a whole number", "IntRange": "a whole number", "FLOAT": "a number", "FloatRange": "a number",
            "STRING": "text"}.get(info["param_type"], info["name"])
    bounds = []
    if info.get("min") is not None:
        bounds.append(f"{'>' if info['min_open'] else '>='} {info['min']}")
    if info.get("max") is not None:
        bounds.append(f"{'<' if info['max_open'] else '<='} {info['max']}")
    said = " ".join([kind, " and ".join(bounds)]) if bounds else kind
    return ("a list of " if param.multiple else "") + said + (f" ({param.metavar})" if param.metavar else "")


def long_name(param: click.Option) -> str:
    """The option's first long name without its dashes (seq-len)."""
    return next((o for o in param.opts if o.startswith("--")), param.opts[0]).lstrip("-")


def read_mapping(path: str) -> dict:
    """The recipe file's top-level mapping, or a refusal saying why it is none."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UnusableInput(f"recipe {path}: " + ("is a directory" if file.is_dir() else "no such file"))
    if file.stat().st_size > MAX_BYTES:
        raise UnusableInput(f"recipe {path}: {file.stat().st_size} bytes; a recipe is a short YAML file")
    try:
        data, nodes = as_written(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        reason = getattr(exc, "problem", None) or type(exc).__name__
        raise UnusableInput(f"recipe {path}: not readable YAML{line}: {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UnusableInput(f"recipe {path}: holds a {type(data).__name__}; a recipe is a mapping of flag: value")
    return {key: text(nodes.get(key), value) for key, value in data.items()}


def as_written(source: str) -> tuple:
    """(the document as YAML reads it, {top-level key: its value's node}: the nodes keep each scalar's text as
    written)."""
    import yaml

    reader = loader()(source)
    try:
        node = reader.get_single_node()
        data = reader.construct_document(node) if node is not None else None
        pairs = node.value if isinstance(node, yaml.MappingNode) else []
        return data, {reader.construct_object(k): v for k, v in pairs if k.tag != "tag:yaml.org,2002:merge"}
    finally:
        reader.dispose()


def text(node, value):
    """A value as a command line would carry it: a scalar's text as written in the file (`steps: 2.7` is "2.7", as
    `--steps 2.7`: click's types convert a Python value more loosely than text: int(2.7) is 2), a list's items so;
    null stays None (the flag's default) and a mapping as YAML read it (an inline config, or refused by the type)."""
    import yaml

    if value is None or isinstance(value, dict):
        return value
    if isinstance(node, yaml.ScalarNode):
        return node.value
    if isinstance(node, yaml.SequenceNode) and isinstance(value, list):
        return [item.value if isinstance(item, yaml.ScalarNode) and v is not None else v
                for item, v in zip(node.value, value)]
    return value


def loader():
    """PyYAML's safe loader, reading 1e-4 as a number as YAML 1.2 and JSON do (YAML 1.1 wants 1.0e-4), and
    refusing a key given twice in one mapping (PyYAML keeps the last silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # a merge (<<) or a complex key: PyYAML's own rules
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
                                 list("-+0123456789."))
    return Loader


def config_json(recipe_path: str, inline: dict) -> str:
    try:
        return json.dumps(inline, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise UnusableInput(f"recipe {recipe_path}: config: the inline DeepSpeed config has a value JSON cannot "
                            f"hold ({exc}); write it as JSON would") from None


def inline_config_path(recipe_path: str, inline: dict) -> Path:
    """Where an inline config is written: named after the recipe and its content, so every rank (and the
    check launch.sh makes first) names and writes the same file."""
    text = config_json(recipe_path, inline)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    owner = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"dstk-{owner}" / "recipes" / digest / f"{Path(recipe_path).name}.config.json"


def inline_in_use(ctx: click.Context) -> Recipe | None:
    """The recipe, when the run reads its inline config (no --config on the command line over it)."""
    recipe = ctx.meta.get(META)
    if recipe is None or recipe.inline is None or ctx.get_parameter_source(CONFIG) != ParameterSource.DEFAULT_MAP:
        return None
    return recipe


def write_inline_config(ctx: click.Context) -> Path | None:
    """The inline config's file, written (atomically, the same bytes on every rank) when the run reads it."""
    from toolkit.files import write_text

    recipe = inline_in_use(ctx)
    if recipe is None:
        return None
    file, text = recipe.inline_file, config_json(recipe.path, recipe.inline)
    if not (file.is_file() and file.read_text(encoding="utf-8") == text):
        file.parent.mkdir(parents=True, exist_ok=True)
        write_text(text, str(file), force=True, flag=f"recipe {recipe.path}'s inline config:")
    return file


def config_named(ctx: click.Context) -> str:
    """The config as messages name it: its path, or the recipe's inline config and the file it is in."""
    recipe = inline_in_use(ctx)
    return f"{recipe.path}'s inline config ({recipe.inline_file})" if recipe else ctx.params[CONFIG]


def recorded(ctx: click.Context, command_line_only: tuple, header: str = "") -> str:
    """What this invocation ran with, as a recipe: every option given on the command line or in the recipe
    (the command line's value where both), in the command's order; the DeepSpeed config inline, as it was
    read (a config file may change or go after the run starts: the saved recipe still continues the run)."""
    import yaml

    from toolkit.config.loader import read_config

    keys = {p.name for p, _ in recipe_keys(ctx.command, command_line_only).values()}
    inline = inline_in_use(ctx)
    out = {}
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if param.name not in keys or source in (None, ParameterSource.DEFAULT) or ctx.params.get(param.name) is None:
            continue
        value = ctx.params[param.name]
        if param.name == CONFIG:
            value = inline.inline if inline is not None else read_config(value)[0]
        out[long_name(param)] = list(value) if isinstance(value, tuple) else value
    if CONFIG in out:
        out[CONFIG] = out.pop(CONFIG)  # last: an inline config is the longest entry
    return header + yaml.safe_dump(out, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)
