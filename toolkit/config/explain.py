"""Turn one jsonschema error into Problems a person can read.

Each message quotes the key as written, says what was expected (from the schema, never a raw dump
of an anyOf) and what DeepSpeed itself would do with the value, which is often "nothing, silently".
"""

import json

from toolkit.config import schema as S
from toolkit.config.problems import Problem

TYPE_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false",
              "string": "a string", "object": "an object {...}", "array": "a list [...]", "null": "null"}
TRUE_WORDS = {"true", "yes", "on", "1", "y", "t"}
BOOL_WORDS = TRUE_WORDS | {"false", "no", "off", "0", "n", "f"}


def json_path(parts) -> str:
    """["zero_optimization", "stage"] -> "$.zero_optimization.stage"; list indices as [i]."""
    out = "$"
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier():
            out += f".{p}"
        else:
            out += f"[{json.dumps(p)}]"
    return out


def show(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def expected(node) -> str:
    """What a schema accepts, in words: 'an integer >= 1 or "auto"'."""
    node = S.resolve(node)
    if node.get("const") == "auto":
        return '"auto"'
    if "anyOf" in node:
        return " or ".join(expected(b) for b in node["anyOf"])
    if "enum" in node:
        return "one of " + ", ".join(show(v) for v in node["enum"])
    types = node.get("type", [])
    words = []
    for t in [types] if isinstance(types, str) else types:
        if t == "string" and node.get("pattern") == "^auto$":
            words.append('"auto"')
            continue
        words.append(TYPE_WORDS.get(t, t) + (_bounds(node) if t in ("integer", "number") else ""))
    return " or ".join(words) or "a different value"


def _bounds(node) -> str:
    parts = [f"{op} {node[k]:g}" for k, op in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                               ("maximum", "<="), ("exclusiveMaximum", "<")) if k in node]
    return " " + " and ".join(parts) if parts else ""


MAX_UNKNOWN_KEYS = 50  # unknown keys of one object explained one by one (with a spelling suggestion each)


def explain_error(err, parent_schema) -> list:
    """Problems for one jsonschema ValidationError. `parent_schema` is the object schema holding
    the failing key (for what DeepSpeed does with it), or None."""
    path = list(err.absolute_path)
    if err.validator == "additionalProperties":
        extra = _extra_keys(err)
        listed = [_unknown_key(path, key, err.schema) for key in extra[:MAX_UNKNOWN_KEYS]]
        return listed + ([_more_unknown(path, extra[MAX_UNKNOWN_KEYS:], err.schema)] if extra[MAX_UNKNOWN_KEYS:] else [])
    if err.validator == "anyOf":
        inner = _one_branch_errors(err)
        if inner and not isinstance(err.instance, str):  # betas with 3 items: say so, not "a list or auto"
            return [p for e in inner for p in explain_error(e, parent_schema)]
        return [Problem(json_path(path), _bad_value(path, err.instance, err.schema, parent_schema))]
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        where = f'"{path[-1]}"' if path else "the top level"
        return [Problem(json_path(path), f'{where} needs the key "{missing}"')]
    if err.validator in ("minItems", "maxItems"):
        return [Problem(json_path(path), f'{_name(path)} has {len(err.instance)} items; expected '
                        f'{err.validator_value} {"or more" if err.validator == "minItems" else "or fewer"}')]
    if err.validator == "pattern" and "examples" in err.schema:  # optimizer/scheduler type: names in words
        return [Problem(json_path(path), _unknown_name(path, err.instance, err.schema))]
    if err.validator == "pattern":
        return [Problem(json_path(path), f'{_name(path)} is {show(err.instance)}; expected a string '
                        f'matching {err.validator_value}')]
    if err.validator in ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                         "pattern", "const"):
        return [Problem(json_path(path), _bad_value(path, err.instance, err.schema, parent_schema))]
    return [Problem(json_path(path), f"{_name(path)}: {err.message[:200]}")]


def _unknown_name(path, value: str, node: dict) -> str:
    """A class name DeepSpeed does not resolve, or resolves to a class that cannot work from JSON."""
    refused = node.get("x-refused", {})
    if value in refused:
        return (f'{_name(path)} is {show(value)}: DeepSpeed finds the class, but {refused[value]}; '
                "use one of " + ", ".join(node["examples"]))
    names = node["examples"]
    hint = S.suggest(value, names)
    case = f' ({node.get("x-case-note", "names are case-sensitive")})' if hint and hint.lower() == value.lower() else ""
    return (f'{_name(path)} is {show(value)}; expected one of ' + ", ".join(names)
            + (f'; did you mean "{hint}"?{case}' if hint else ""))


def _one_branch_errors(err) -> list:
    """For a value failing "X or auto": its errors against X alone when X has the same type."""
    branches = [b for b in err.schema["anyOf"] if b != {"$ref": "#/$defs/auto"}]
    if len(branches) != 1:
        return []
    return [e for e in err.context if e.validator != "type" and e.relative_schema_path[0] == 0]


def _name(path) -> str:
    """The key as written: "stage", or "betas"[2] for a list item."""
    if path and isinstance(path[-1], str):
        return f'"{path[-1]}"'
    if len(path) >= 2 and isinstance(path[-2], str):
        return f'"{path[-2]}"[{path[-1]}]'
    return json_path(path)


def _extra_keys(err) -> list:
    known = err.schema.get("properties", {})
    return [k for k in err.instance if k not in known]


def _more_unknown(path, keys: list, node) -> Problem:
    """One problem for the unknown keys past MAX_UNKNOWN_KEYS of one object (no spelling search for each:
    a file of 700,000 stray keys is reported in a second, not in minutes)."""
    shown = ", ".join(f'"{k}"' for k in keys[:3])
    return Problem(json_path(path), f"{len(keys):,} more unknown keys here ({shown}, ...), beyond the first "
                                    f"{MAX_UNKNOWN_KEYS} listed ({_fate_of_unknown(path, node).replace(' it ', ' them ')})")


def _unknown_key(path, key, node) -> Problem:
    where = json_path(path + [key])
    removed = S.removed_at(node)
    if key in removed:
        return Problem(where, f'"{key}" was removed in DeepSpeed 0.19 (DeepSpeed refuses the config): '
                              f'{removed[key]}')
    hint = S.suggest(key, S.properties(node))
    if hint:
        advice = f'did you mean "{hint}"?'
    else:
        homes = [h for h in S.homes(key) if h != ".".join(map(str, path))]
        advice = (f'"{key}" belongs under "{homes[0]}"' if homes and homes[0]
                  else f'"{key}" belongs at the top level' if homes else "no such key here")
    return Problem(where, f'unknown key "{key}": {advice} ({_fate_of_unknown(path, node)})')


def _fate_of_unknown(path, node) -> str:
    if node.get("x-deepspeed-parser") == "pydantic":
        return "DeepSpeed refuses it: extra fields not permitted"
    if path and path[-1] == "params":
        return "the class gets an unexpected keyword argument at deepspeed.initialize"
    return "DeepSpeed would ignore it silently"


def _bad_value(path, value, node, parent) -> str:
    """`"stage" is the string "2"; write 2 without quotes (DeepSpeed converts it silently)`."""
    name, want = _name(path), expected(node)
    pydantic = bool(parent) and parent.get("x-deepspeed-parser") == "pydantic"
    if value == "auto":
        fate = ("DeepSpeed drops it silently and uses the default" if pydantic
                else "DeepSpeed alone cannot use it")
        return (f'{name} is "auto", but the HF Trainer/Accelerate do not fill this key ({fate}); '
                f"write {want}")
    if isinstance(value, str):
        coerced = _coercion(value, node, pydantic)
        if coerced:
            return f'{name} is the string {show(value)}; {coerced}'
    if isinstance(value, bool) and ("integer" in want or "number" in want):
        return f"{name} is {show(value)}, a boolean; expected {want}"
    hint = S.suggest(value, _enum_strings(node)) if isinstance(value, str) else None
    return f"{name} is {show(value)}; expected {want}" + (f'; did you mean "{hint}"?' if hint else "")


def _branches(node) -> list:
    return [S.resolve(node)] + [S.resolve(b) for b in S.resolve(node).get("anyOf", [])]


def _enum_values(node) -> list:
    return [v for b in _branches(node) for v in b.get("enum", [])]


def _enum_strings(node) -> list:
    return [v for v in _enum_values(node) if isinstance(v, str)]


def _types(node) -> set:
    """JSON types a node accepts (the auto branch's string excluded)."""
    out = set()
    for b in _branches(node):
        if "const" not in b:
            out.update([b["type"]] if isinstance(b.get("type"), str) else b.get("type", []))
    return out


def _coercion(text: str, node, pydantic: bool) -> str | None:
    """A message for a number or boolean written as a string, saying what DeepSpeed does with it."""
    want, types, values = expected(node), _types(node), _enum_values(node)
    try:
        number = json.loads(text.strip())
    except ValueError:
        number = None
    numeric = isinstance(number, (int, float)) and not isinstance(number, bool)
    if numeric and (types & {"integer", "number"} or number in values):
        fate = ("DeepSpeed converts it silently, other readers may not" if pydantic else
                "DeepSpeed keeps it a string and fails later, e.g. at the first optimizer step")
        return f"write {show(number)} without quotes ({fate}); expected {want}"
    if text.strip().lower() in BOOL_WORDS and "boolean" in types:
        as_bool = text.strip().lower() in TRUE_WORDS
        fate = (f"DeepSpeed converts it to {show(as_bool)}" if pydantic else
                "DeepSpeed treats any non-empty string as true, even \"false\"")
        return f"write {show(as_bool)} without quotes ({fate})"
    return None
