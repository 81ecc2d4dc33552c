"""Turn one of DeepSpeed's pydantic config models into a closed JSON Schema object.

Every field becomes a property (under its alias too: DeepSpeed sets populate_by_name, so both
spellings work), with DeepSpeed's own default, bounds (Field gt/ge/lt/le), enum values and the
docstring DeepSpeed writes below the field. A field takes null where DeepSpeed's model does
(Optional[...] types, or a validator that maps None to the default). Used by `build` and by the test that checks
schema.json against the installed DeepSpeed.
"""

import ast
import enum
import inspect
import json
import textwrap
import typing
from pathlib import PurePath

# Fields DeepSpeed documents nowhere (no docstring, no Field description).
FALLBACK_DOCS = {
    "pipeline_loading_checkpoint": "Force loading checkpoints in pipeline mode (ZeRO stage 3 only).",
    "enabled": "Turn this feature on or off.",
    "prof_all": "Profile every collective operation.",
    "prof_ops": "Names of the collective operations to profile when prof_all is false.",
    "verbose": "Print every logged operation immediately.",
    "debug": "Add the caller's name to each logged operation.",
    "max_out_tokens": "Maximum tokens generated per call.",
    "inference_tp_size": "Tensor-parallel size used for generation.",
    "release_inference_cache": "Free the inference cache after generation.",
    "pin_parameters": "Pin parameters in memory during generation.",
    "tp_gather_partition_size": "Partitions gathered at a time for tensor-parallel generation.",
    "enable_cuda_graph": "Capture generation in CUDA graphs.",
    "tp_group": "Tensor-parallel process group (a Python object).",
    "injection_policy_tuple": "Injection policy (set in code).",
    "num_bits": "Bits per quantized value.", "q_type": "Quantization type.",
    "q_groups": "Quantization groups.", "quantized_initialization": "Quantize at initialisation.",
    "post_init_quant": "Quantize after initialisation.",
    "classes": "Module classes treated as ZeRO-3 leaf modules (dotted names).",
    "names": "Module names treated as ZeRO-3 leaf modules.",
    "name_suffixes": "Module name suffixes treated as ZeRO-3 leaf modules.",
}


def model_schema(model, description: str) -> dict:
    """A closed object schema for `model` (a DeepSpeedConfigModel subclass)."""
    docs = field_docs(model)
    props = {}
    for name, field in model.model_fields.items():
        prop = field_schema(field, docs.get(name) or field.description or FALLBACK_DOCS.get(name, ""))
        if not _allows_null(prop) and accepts_null(model, field.alias or name):
            prop = _nullable(prop)  # e.g. leaf_module: a before-validator turns null into the defaults
        if field.alias and field.alias != name:
            props[field.alias] = prop
            props[name] = {**prop, "description": f"Same as \"{field.alias}\". {prop['description']}"}
        else:
            props[name] = prop
    return {"type": "object", "description": description, "additionalProperties": False,
            "x-deepspeed-parser": "pydantic", "x-deepspeed-model": f"{model.__module__}.{model.__qualname__}",
            "properties": props}


def accepts_null(model, key: str) -> bool:
    """Whether DeepSpeed's model takes `key: null` (Optional fields, validators that map None to a
    default). Builds the model with that one key, as DeepSpeed does from the JSON section."""
    try:
        model(**{key: None})
    except Exception:  # pydantic's ValidationError, or a validator's own AssertionError/ValueError
        return False
    return True


def field_docs(model) -> dict:
    """Attribute docstrings: the string literal right after `name: type = ...` in each class body."""
    docs = {}
    for cls in reversed(model.__mro__):
        if not cls.__module__.startswith("deepspeed"):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_schema(field, doc: str) -> dict:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    doc = doc.replace("``", '"')
    if extra.get("deprecated") and not doc.startswith("Deprecated"):
        new = extra.get("new_param")
        doc = f"Deprecated{f': use {new} instead' if new else ''}. {doc}".strip()
    out = {"description": doc, **({"deprecated": True} if extra.get("deprecated") else {})}
    out.update({k: v for k, v in type_schema(field.annotation).items() if k != "description"})
    for meta in field.metadata:  # annotated_types Gt/Ge/Lt/Le
        for attr, keyword in (("gt", "exclusiveMinimum"), ("ge", "minimum"), ("lt", "exclusiveMaximum"),
                              ("le", "maximum")):
            if getattr(meta, attr, None) is not None:
                out[keyword] = getattr(meta, attr)
    default = field.get_default(call_default_factory=True)
    if _jsonable(default):
        out["default"] = _plain(default)
    return out


def type_schema(annotation) -> dict:
    """Python annotation -> JSON Schema type / enum / items / nested object."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        parts = [type_schema(a) for a in args if a is not type(None)]
        merged = parts[0] if len(parts) == 1 else {"type": [p["type"] for p in parts]}
        if type(None) in args:
            merged = _nullable(merged)
        return merged
    if origin is typing.Literal:
        return {"type": _json_type(type(args[0])), "enum": list(args)}
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        values = list(dict.fromkeys(m.value for m in annotation))  # drops aliases such as max_stage
        return {"type": _json_type(type(values[0])), "enum": values}
    if inspect.isclass(annotation) and hasattr(annotation, "model_fields"):
        return model_schema(annotation, (annotation.__doc__ or "").strip().split("\n")[0])
    if origin in (list, tuple) or annotation in (list, tuple):
        return {"type": "array", **({"items": type_schema(args[0])} if args and args[0] is not Ellipsis else {})}
    if origin is dict or annotation is dict or annotation is typing.Dict:
        return {"type": "object"}
    return {"type": _json_type(annotation)}


def _json_type(py) -> str:
    if py is bool:
        return "boolean"
    if py is int:
        return "integer"
    if py is float:
        return "number"
    if py is str or (inspect.isclass(py) and issubclass(py, PurePath)):
        return "string"
    return "null"  # a Python object (process group, torch.dtype): cannot be written in JSON


def _allows_null(schema: dict) -> bool:
    types = schema.get("type", [])
    return "null" in ([types] if isinstance(types, str) else types)


def _nullable(schema: dict) -> dict:
    out = dict(schema)
    types = out["type"] if isinstance(out["type"], list) else [out["type"]]
    out["type"] = types + ["null"] if "null" not in types else types
    if "enum" in out:
        out["enum"] = out["enum"] + [None]
    return out


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "model_dump"):
        return json.loads(value.model_dump_json(by_alias=True))
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)  # DeepSpeed's pp_int prints as "5e8" but is a plain int
    return value


def _jsonable(value) -> bool:
    try:
        json.dumps(_plain(value))
        return True
    except (TypeError, ValueError):
        return False
