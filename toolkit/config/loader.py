"""Read a DeepSpeed config file the way DeepSpeed does, or say in one line why it cannot be read.

`load_config(path, world_size=, pp=, strict=)` is the one reader every command uses (validate,
train, partition --config): reading, then the schema, then the rules across fields, as one list
of Problems. The callers decide what is fatal (`problems.raise_errors`).

DeepSpeed reads files with hjson (comments, trailing commas and unquoted strings pass) and raises
on duplicate keys (runtime/config.py). dstk reads strict JSON first and falls back to hjson with a
WARNING, reports duplicate keys as ERRORs with their path, and raises UnusableInput for input no
parser should be trusted with: missing, binary, non-UTF-8, broken, not an object, NaN/Infinity,
integers past int64, nesting past MAX_DEPTH, files past MAX_BYTES.
"""

import json
import math
from pathlib import Path

import hjson

from toolkit.config.explain import json_path
from toolkit.config.problems import ERROR, WARNING, Problem
from toolkit.errors import UnusableInput

MAX_BYTES = 16 * 1024**2  # a real DeepSpeed config is a few KiB
MAX_DEPTH = 100  # DeepSpeed configs nest 4 levels; deeper is garbage (and RecursionError bait)
INT_LIMIT = 2**63  # DeepSpeed/torch hand integers to C++ as int64


class _Pairs(dict):
    """A JSON object that remembers keys it saw more than once (the last value wins, as in json)."""

    def __init__(self, pairs):
        super().__init__(pairs)
        seen, self.duplicates = set(), []
        for key, _ in pairs:
            if key in seen and key not in self.duplicates:
                self.duplicates.append(key)
            seen.add(key)


def load_config(path, world_size: int | None = None, pp: int | None = None, strict: bool = False,
                sp: int | None = None) -> tuple:
    """(config dict, problems): read like DeepSpeed, then the schema, then the rules for `world_size`
    processes and `pp` stages. strict: "auto" is an error. Raises UnusableInput when unreadable."""
    from toolkit.config.rules import check_rules
    from toolkit.config.validate import check_schema

    cfg, problems = read_config(path)
    problems += check_schema(cfg, strict=strict) + check_rules(cfg, world_size=world_size, pp=pp, sp=sp)
    return cfg, problems


def read_config(path) -> tuple:
    """(config dict, problems) for a config file; raises UnusableInput when it cannot be read."""
    path = Path(path)
    if not path.exists():
        raise UnusableInput(f"{path}: no such file")
    if path.is_dir():
        raise UnusableInput(f"{path}: is a directory, not a config file")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise UnusableInput(f"{path}: {size / 1024**2:.1f} MiB is too big for a DeepSpeed config "
                                f"(limit {MAX_BYTES // 1024**2} MiB)")
        data = path.read_bytes()
    except OSError as exc:
        raise UnusableInput(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_config_text(_decode(data, path), source=str(path))


def _decode(data: bytes, source) -> str:
    if b"\x00" in data:
        raise UnusableInput(f"{source}: binary data (NUL bytes), not a JSON config")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UnusableInput(f"{source}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                            f"{exc.start})") from None


def parse_config_text(text: str, source: str = "<string>") -> tuple:
    """(config dict, problems) for config text; raises UnusableInput like read_config."""
    if len(text) > MAX_BYTES:
        raise UnusableInput(f"{source}: too big for a DeepSpeed config (limit {MAX_BYTES // 1024**2} MiB)")
    if not text.strip():
        raise UnusableInput(f"{source}: empty file, expected a JSON object")
    problems = []
    try:
        cfg = _parse_strict(text, source)
    except json.JSONDecodeError as strict_error:
        cfg = _parse_hjson(text, source, strict_error)
        problems.append(Problem("$", "not strict JSON (comments, trailing commas or unquoted strings; "
                                f"the first at line {strict_error.lineno} column {strict_error.colno}): "
                                "DeepSpeed reads it with hjson, but json.load (HF Trainer, other tools) "
                                "fails on it", WARNING))
    except RecursionError:
        raise UnusableInput(f"{source}: nested too deeply to parse (limit {MAX_DEPTH} levels)") from None
    if not isinstance(cfg, dict):
        raise UnusableInput(f"{source}: the top level is {_kind(cfg)}; a DeepSpeed config is a JSON object {{...}}")
    problems += _check_tree(cfg, source)
    return _plain(cfg), problems


def _parse_strict(text: str, source: str):
    def no_constant(name):
        raise ValueError(name)  # json calls this for NaN, Infinity, -Infinity

    try:
        return json.loads(text, object_pairs_hook=_Pairs, parse_constant=no_constant)
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        raise UnusableInput(f"{source}: {exc} is not a number in JSON (JSON has no NaN or Infinity; DeepSpeed would "
                            "pass it on as a float)") from None


def _parse_hjson(text: str, source: str, strict_error):
    try:
        return hjson.loads(text, object_pairs_hook=_Pairs)
    except RecursionError:
        raise UnusableInput(f"{source}: nested too deeply to parse (limit {MAX_DEPTH} levels)") from None
    except Exception:  # hjson raises HjsonDecodeError or ValueError; the JSON message is clearer
        raise UnusableInput(f"{source}: broken JSON at line {strict_error.lineno} column "
                            f"{strict_error.colno}: {strict_error.msg}") from None


def _kind(value) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _check_tree(cfg, source) -> list:
    """Duplicate keys -> ERROR problems; NaN/Infinity, huge integers, deep nesting -> UnusableInput.
    Iterative (an explicit stack), so depth cannot raise RecursionError here."""
    problems, stack = [], [(cfg, [])]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise UnusableInput(f"{source}: nested deeper than {MAX_DEPTH} levels at {json_path(path[:5])}...")
        if isinstance(value, float) and not math.isfinite(value):
            raise UnusableInput(f"{source}: {json_path(path)} is {value}; JSON has no NaN or Infinity")
        if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
            raise UnusableInput(f"{source}: {json_path(path)} is {value}, beyond a 64-bit integer")
        if isinstance(value, dict):
            for key in getattr(value, "duplicates", []):
                problems.append(Problem(json_path(path + [key]), f'duplicate key "{key}": DeepSpeed refuses '
                                        "the file; the last value would win in other readers", ERROR))
            stack += [(v, path + [k]) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, path + [i]) for i, v in enumerate(value)]
    return problems


def _plain(value):
    """_Pairs -> dict, recursively (depth is already bounded by _check_tree)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
