"""Small constructors for JSON Schema fragments, shared by the hand-written schema sections.

Used only by `build` (which writes schema.json); nothing at run time imports this.
"""

AUTO_REF = {"$ref": "#/$defs/auto"}
_NO_DEFAULT = object()


def prop(type_, description, default=_NO_DEFAULT, auto=False, **constraints):
    """One key: `type_` is a JSON type name or list of names; `constraints` are minimum, enum, ...

    auto=True allows the string "auto" (a value the HF Trainer / Accelerate fills in) through an
    anyOf with `$defs/auto`, so validation can tell "auto" apart from other strings.
    A default of None (DeepSpeed's `param_dict.get(key, None)`) also allows null: written as null,
    the key reads exactly as if it were absent.
    """
    body = {"type": type_, **constraints}
    if default is None:
        body = nullable(body)
    out = {"description": description}
    if auto:
        out["anyOf"] = [exclude_auto(body), AUTO_REF]
    else:
        out.update(body)
    if default is not _NO_DEFAULT:
        out["default"] = default
    return out


def exclude_auto(body: dict) -> dict:
    """A string-typed branch would take "auto" as a literal value (a path named "auto"): keep it
    out, so "auto" only matches `$defs/auto` and validation reports it as one."""
    types = [body.get("type")] if isinstance(body.get("type"), str) else body.get("type", [])
    if "string" in types and "enum" not in body:
        return {**body, "not": {"const": "auto"}}
    return body


def nullable(body: dict) -> dict:
    """`body` that also accepts null (and None among its enum values)."""
    types = [body["type"]] if isinstance(body["type"], str) else list(body["type"])
    out = {**body, "type": types + ["null"] if "null" not in types else types}
    if "enum" in out and None not in out["enum"]:
        out["enum"] = out["enum"] + [None]
    return out


def section(description, properties, closed=True, **extra):
    """An object with a fixed key set (closed) or one DeepSpeed passes on as a whole (open).
    default=None in `extra`: DeepSpeed reads the section with `.get(key, None)`, so null is allowed."""
    out = {"type": "object", "description": description, "properties": properties}
    out["additionalProperties"] = not closed
    out.update(extra)
    return nullable(out) if "default" in extra and extra["default"] is None else out


def flag(description, default=False, auto=False):
    return prop("boolean", description, default, auto=auto)


def count(description, default=_NO_DEFAULT, minimum=0, auto=False):
    return prop("integer", description, default, auto=auto, minimum=minimum)


def real(description, default=_NO_DEFAULT, auto=False, **constraints):
    return prop("number", description, default, auto=auto, **constraints)


def text(description, default=_NO_DEFAULT, **constraints):
    return prop("string", description, default, **constraints)


def enabled(what, default=False, auto=False):
    return flag(f"Turn {what} on or off.", default, auto=auto)


def betas(description, default=(0.9, 0.999), auto=False):
    """A (beta1, beta2) pair, each in [0, 1)."""
    item = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
    return prop("array", description, list(default), auto=auto, items=item, minItems=2, maxItems=2)
