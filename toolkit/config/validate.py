"""Stage (a) of validation: a config dict against the JSON Schema, every problem with its JSON path.

    >>> print(*check_schema({"train_batch_size": 8, "zero_optimization": {"stag": 1}}))
    error: $.zero_optimization.stag: unknown key "stag": did you mean "stage"? (DeepSpeed refuses ...)

Stage (b), rules across fields for a world size, lives in rules.py. Neither needs torch.
"""

import copy
import functools

from jsonschema import Draft202012Validator

from toolkit.config import schema as S
from toolkit.config.explain import explain_error, json_path
from toolkit.config.problems import ERROR, NOTE, WARNING, Problem

AUTO_NOTE = ('is "auto": the HF Trainer/Accelerate must fill this before DeepSpeed sees it '
             '(DeepSpeed alone {fate})')


@functools.lru_cache(maxsize=2)
def _validator(auto_allowed: bool) -> Draft202012Validator:
    """The schema as is, or with `$defs/auto` matching nothing (to find where "auto" was used)."""
    schema = S.load_schema()
    if not auto_allowed:
        schema = copy.deepcopy(schema)
        schema["$defs"]["auto"] = {"not": {}}
    return Draft202012Validator(schema)


def check_schema(cfg: dict, strict: bool = False) -> list:
    """All schema problems of `cfg`, sorted by path. strict=True makes "auto" an ERROR, not a NOTE."""
    problems, bad_paths = [], set()
    for err in _validator(True).iter_errors(cfg):
        bad_paths.add(tuple(err.absolute_path))
        problems += explain_error(err, _schema_at(list(err.absolute_path)[:-1]))
    for err in _validator(False).iter_errors(cfg):
        path = tuple(err.absolute_path)
        if err.instance == "auto" and path not in bad_paths:
            problems.append(_auto_problem(list(path), strict))
    problems += deprecated_keys(cfg)
    return sorted(dict.fromkeys(problems), key=lambda p: (p.path, p.message))


def _auto_problem(path: list, strict: bool) -> Problem:
    pydantic = _schema_at(path[:-1]).get("x-deepspeed-parser") == "pydantic"
    fate = "drops it silently and uses the default" if pydantic else "cannot use it"
    message = f'"{path[-1]}" ' + AUTO_NOTE.format(fate=fate)
    if strict:
        message += "; refused here (dstk train, validate --strict): write the value"
    return Problem(json_path(path), message, ERROR if strict else NOTE)


def _schema_at(path: list) -> dict:
    """The schema node for a path into the config (list indices go through `items`)."""
    node = S.load_schema()
    for part in path:
        if isinstance(part, int):
            node = S.resolve(node.get("items", {}))
        else:
            node = S.resolve(S.properties(node).get(part, {}))
    return node


def deprecated_keys(cfg: dict) -> list:
    """WARNING for each key the schema marks deprecated (DeepSpeed still reads it, with a warning)."""
    found = []

    def walk(value, node, path):
        if not isinstance(value, dict):
            return
        known = S.properties(node)
        for key, sub in value.items():
            if key in known:
                if known[key].get("deprecated"):
                    found.append(Problem(json_path(path + [key]), f'"{key}": {known[key]["description"]}',
                                         WARNING))
                walk(sub, S.resolve(known[key]), path + [key])

    walk(cfg, S.load_schema(), [])
    return found
