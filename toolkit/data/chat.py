"""Chat rows -> checked messages -> the text the chat template renders, with each assistant turn's characters.

    to_messages     chat / alpaca / sharegpt rows -> [{"role", "content"}], refused with the file and row
    chat_spans      the rendered conversation and the (start, end) characters of its assistant turns
    marks           which tokens start inside those spans (from the tokenizer's character offsets)
    renderer        the compiled template, rendered directly where it agrees with apply_chat_template
"""

import json
from operator import itemgetter

import numpy as np

import toolkit.data.tokens as tokens
from toolkit.errors import ConfigError, UnusableInput

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "model": "assistant", "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")


def describe(value) -> str:
    return "missing" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"


def to_messages(fmt: str, record: dict, row: int, source: str) -> list:
    """A chat/alpaca/sharegpt row as a checked list of {"role", "content"} (strings)."""
    where = f"{source} row {row}"
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise UnusableInput(f"{where}: {key!r} is {describe(record.get(key))}, not a string")
        extra = record.get("input")
        extra = None if isinstance(extra, float) and extra != extra else extra  # an empty CSV cell reads as NaN
        if extra is not None and not isinstance(extra, str):
            raise UnusableInput(f"{where}: 'input' is {describe(extra)}, not a string")
        user = record["instruction"] + (f"\n\n{extra}" if extra and extra.strip() else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    key, role_key, text_key = ("messages", "role", "content") if fmt == "chat" else ("conversations", "from", "value")
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise UnusableInput(f"{where}: {key!r} is {'empty' if turns == [] else describe(turns)}; it must be a "
                            f"non-empty list of {{{role_key!r}, {text_key!r}}} objects")
    messages = []
    for n, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str):
            raise UnusableInput(f"{where}: message {n} has no {role_key!r} (a string); each message needs "
                                f"{role_key!r} and {text_key!r}")
        role = turn[role_key] if fmt == "chat" else SHAREGPT_ROLES.get(turn[role_key])
        if role not in ROLES:
            known = ROLES if fmt == "chat" else sorted(SHAREGPT_ROLES)
            raise UnusableInput(f"{where}: message {n} has {role_key} {turn[role_key]!r}; expected one of {known}")
        if not isinstance(turn.get(text_key), str):
            raise UnusableInput(f"{where}: message {n} ({turn[role_key]}) {text_key!r} is {describe(turn.get(text_key))}, "
                                "not a string")
        messages.append({"role": role, "content": turn[text_key]})
    return messages


def check_chat_template(tokenizer) -> None:
    """Chat formats need a template: the tokenizer's, or --chat-template FILE."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this data is chat-formatted but the tokenizer has no chat template to render it with; "
                          "pass --chat-template FILE (a Jinja template, e.g. ChatML), or --format with another "
                          "format")


def check_template_syntax(template: str, path: str) -> None:
    """--chat-template FILE must compile: a Jinja syntax error is refused at once, naming the file, the
    line and jinja's message. (A template that raises on some conversation is named with the row that
    made it raise, in render_chat.) Rendered as transformers renders it, on a one-turn conversation."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template([[{"role": "user", "content": "hello"}]], chat_template=template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path}: line {exc.lineno}: {exc.message} (a Jinja syntax error); "
                          "fix the template") from None
    except Exception:  # noqa: BLE001 - it compiled; refusing this probe conversation is the template's right
        pass


def render_chat(messages: list, tok, source: str = "", row: int = 0) -> tuple[list, list]:
    """(input_ids, is_assistant per token) of one conversation rendered with the chat template."""
    full, spans = chat_spans(messages, tok, source, row)
    if tokens.backend(tok) is None:
        return tokens_by_piece(full, spans, tok)
    encoded = tokens.encode(tok, [full], offsets=True)[0]
    return encoded.ids, marks(encoded.offsets, spans).tolist()


def chat_spans(messages: list, tok, source: str = "", row: int = 0, render=None) -> tuple[str, list]:
    """_chat_spans, with a template's own error named by the row that raised it."""
    from jinja2 import TemplateError

    try:
        return _chat_spans(messages, tok, source, row, render)
    except ConfigError:  # dstk's own refusal (UnusableInput included), already naming the row
        raise
    except TemplateError as exc:
        line = f" (template line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise UnusableInput(f"{source} row {row}: the chat template failed{line}: {exc.message or exc}; fix the "
                            "row or the template (--chat-template FILE)") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:  # Python inside Jinja
        raise UnusableInput(f"{source} row {row}: the chat template failed: {type(exc).__name__}: {exc}; fix the "
                            "row or the template (--chat-template FILE)") from None


def _chat_spans(messages: list, tok, source: str = "", row: int = 0, render=None) -> tuple[str, list]:
    """(the conversation rendered with the chat template, [(start, end)] characters of each assistant turn).

    An assistant turn's characters run from the end of render(messages[:i], add_generation_prompt)
    to the end of render(messages[:i+1]) (its content and end-of-turn marker); both renders must be
    prefixes of the whole conversation's, else the template rewrites earlier turns and is refused."""
    render = render or renderer(tok)
    full = render(messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(messages[:i], generation_prompt=True) if i else ""
        end = full if i == len(messages) - 1 else render(messages[: i + 1], generation_prompt=False)
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise ConfigError(f"{source} row {row}: the chat template renders turn {i + 1} differently once later "
                              "turns follow (the text of a conversation's start is not a prefix of the whole), so "
                              "the assistant's tokens cannot be found; pass --chat-template FILE with a template "
                              "that keeps earlier turns as they are, or --train-on all")
        spans.append((len(start), len(end)))
    return full, spans


def marks(offsets: list, spans: list) -> np.ndarray:
    """Per token (its (start, end) characters): does it start inside one of `spans` (sorted, disjoint)?"""
    starts = np.fromiter(map(itemgetter(0), offsets), np.int64, len(offsets))  # C-level map: no Python loop body
    if not spans:
        return np.zeros(len(starts), bool)
    lo, hi = np.asarray(spans, np.int64).T
    k = np.searchsorted(lo, starts, side="right") - 1
    return (k >= 0) & (starts < hi[np.maximum(k, 0)])


def tokens_by_piece(full: str, spans: list, tok) -> tuple[list, list]:
    """Slow tokenizers (no character offsets): the text between and inside the spans tokenized piece by piece."""
    ids, flags, cut = [], [], 0
    for a, b in spans + [(len(full), len(full))]:
        for text, mark in ((full[cut:a], False), (full[a:b], True)):
            piece = tok(text, add_special_tokens=False)["input_ids"] if text else []
            ids, flags = ids + piece, flags + [mark] * len(piece)
        cut = b
    return ids, flags


def renderer(tok):
    """render(messages, generation_prompt) -> tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=
    generation_prompt) for checked messages (plain {role, content} strings): the compiled template rendered with
    the special tokens, as apply_chat_template renders it after copying and normalising every message (which
    costs more than the render itself), where the two agree on a probe conversation; else apply_chat_template."""
    special = tok.special_tokens_map
    text = tok.get_chat_template() if isinstance(getattr(tok, "chat_template", None), (str, dict)) else None
    key = (text, json.dumps(special, sort_keys=True, default=str))
    if key not in _TEMPLATES:
        _TEMPLATES[key] = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(text)
            same = all(compiled.render(messages=PROBE[:n], tools=None, documents=None, add_generation_prompt=g,
                                       **special)
                       == tok.apply_chat_template(PROBE[:n], tokenize=False, add_generation_prompt=g)
                       for n in (2, 3, 5) for g in (False, True))
            _TEMPLATES[key] = compiled if same else None
        except Exception:  # noqa: BLE001 - transformers' own path renders it (and names the error per row)
            pass
    compiled = _TEMPLATES[key]
    if compiled is None:
        return lambda messages, generation_prompt: tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
    return lambda messages, generation_prompt: compiled.render(
        messages=messages, tools=None, documents=None, add_generation_prompt=generation_prompt, **special)


_TEMPLATES: dict = {}
PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}]
