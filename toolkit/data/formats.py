"""Row formats -> token ids and labels, one example (document) per row; packing comes later.

    text               {"text": ...}                      loss on every token (+ eos)
    prompt-completion  {"prompt", "completion"|"response"} prompt + completion + eos; loss on the completion
    chat               {"messages": [{role, content}]}    the tokenizer's chat template; loss on assistant turns
    alpaca             {"instruction", "input"?, "output"} -> chat (user: instruction + input, assistant: output)
    sharegpt           {"conversations": [{from, value}]} -> chat (human/gpt/system -> user/assistant/system)
    classification     {"text", "label": int}             --task classification: one label per row

--train-on all puts the loss on every token instead (prompt and every turn). Labels are -100 where
no loss is taken. An encoder works on a batch of rows (datasets .map(batched=True, with_indices=True))
and refuses a malformed row with the file and its row number.
"""

import json

from models import task_named
from toolkit.errors import ConfigError, UnusableInput

IGNORE_INDEX = -100  # label value the loss skips (HF and torch cross_entropy convention)
FORMATS = ("text", "prompt-completion", "chat", "alpaca", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "model": "assistant", "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")


def infer_format(columns, task: str, fmt: str, text_field: str = "text") -> tuple[str, str]:
    """(format, a line saying how it was chosen) from --format and the dataset's columns."""
    columns = set(columns)
    if task_named(task) == "sequence-classification":
        _need(columns, (text_field, "label"), "classification")
        return "classification", f"format classification (--task classification): {text_field!r} and 'label'"
    if fmt != "auto":
        _need(columns, _required(fmt, columns, text_field), fmt)
        return fmt, f"format {fmt} (--format)"
    found = [(f, keys) for f, keys in (("chat", ("messages",)), ("sharegpt", ("conversations",)),
                                       ("alpaca", ("instruction", "output")), ("prompt-completion", ("prompt",)),
                                       ("text", (text_field,))) if all(k in columns for k in keys)]
    if len(found) != 1:
        what = "matches several formats: " + ", ".join(f for f, _ in found) if found else "matches no format"
        raise ConfigError(f"the data's columns {sorted(columns)} {what}; pass --format ({', '.join(FORMATS)})"
                          + ("" if found else " or --text-field COLUMN"))
    fmt, keys = found[0]
    _need(columns, _required(fmt, columns, text_field), fmt)
    return fmt, f"format {fmt} inferred from the column(s) {', '.join(map(repr, keys))} (--format to choose)"


def _required(fmt: str, columns: set, text_field: str) -> tuple:
    if fmt == "prompt-completion":
        return ("prompt", "response" if "response" in columns and "completion" not in columns else "completion")
    return {"text": (text_field,), "chat": ("messages",), "sharegpt": ("conversations",),
            "alpaca": ("instruction", "output")}[fmt]


def _need(columns: set, keys, fmt: str) -> None:
    missing = [k for k in keys if k not in columns]
    if missing:
        raise ConfigError(f"--format {fmt} needs the column(s) {missing}; the data has {sorted(columns)}"
                          + ("; point --text-field at the column that holds the text" if fmt in (
                              "text", "classification") else ""))


class Encoder:
    """A picklable batched map function (datasets may run it in num_proc worker processes)."""

    def __init__(self, fmt: str, tokenizer, source: str, train_on: str = "assistant", text_field: str = "text",
                 strip: bool = False):
        self.fmt, self.tok, self.source, self.train_on, self.text_field = fmt, tokenizer, source, train_on, text_field
        self.strip = strip  # plain-text files: a paragraph without its surrounding blank lines
        self.eos = _eos(tokenizer)

    def __call__(self, batch: dict, indices: list) -> dict:
        """Columns input_ids, labels (or label), length (tokens) and trained (tokens with a loss)."""
        if self.fmt == "classification":
            out = self._classification(batch, indices)
            return {**out, "length": [len(i) for i in out["input_ids"]], "trained": [1] * len(indices)}
        out = {"input_ids": [], "labels": [], "length": [], "trained": []}
        for k, row in enumerate(indices):
            record = {key: values[k] for key, values in batch.items()}
            if self.strip:
                record[self.text_field] = record[self.text_field].strip()
                if not record[self.text_field]:
                    continue  # whitespace between paragraphs
            ids, labels = self.encode(record, row + 1)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["length"].append(len(ids))
            out["trained"].append(sum(t != IGNORE_INDEX for t in labels[1:]))
        return out

    def encode(self, record: dict, row: int) -> tuple[list, list]:
        """(input_ids, labels) of one row; `row` counts from 1 for messages."""
        if self.fmt == "text":
            ids = self._ids(self._str(record, self.text_field, row)) + self.eos
            return ids, list(ids)
        if self.fmt == "prompt-completion":
            answer_key = "completion" if "completion" in record else "response"
            prompt = self._ids(self._str(record, "prompt", row))
            answer = self._ids(self._str(record, answer_key, row)) + self.eos
            masked = prompt if self.train_on == "all" else [IGNORE_INDEX] * len(prompt)
            return prompt + answer, masked + answer
        messages = to_messages(self.fmt, record, row, self.source)
        ids, trained = render_chat(messages, self.tok, self.source, row)
        return ids, [t if (m or self.train_on == "all") else IGNORE_INDEX for t, m in zip(ids, trained)]

    def _classification(self, batch: dict, indices: list) -> dict:
        out = {"input_ids": [], "label": []}
        for k, row in enumerate(indices):
            record = {key: values[k] for key, values in batch.items()}
            label = record.get("label")
            if not isinstance(label, int) or isinstance(label, bool) or label < 0:
                raise ConfigError(f"{self.source} row {row + 1}: 'label' is {json.dumps(label)[:40]}; classification "
                                  "rows need an integer 'label' >= 0 (a class index)")
            out["input_ids"].append(self._ids(self._str(record, self.text_field, row + 1), special=True))
            out["label"].append(label)
        return out

    def _ids(self, text: str, special: bool = False) -> list:
        return self.tok(text, add_special_tokens=special)["input_ids"]

    def _str(self, record: dict, key: str, row: int) -> str:
        value = record.get(key)
        if not isinstance(value, str):
            raise ConfigError(f"{self.source} row {row}: {key!r} is {_kind(value)}, not a string; fix the row"
                              + (", or point --text-field at the field that holds the text" if key == self.text_field
                                 else ""))
        return value


def _kind(value) -> str:
    return "missing" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"


def _eos(tokenizer) -> list:
    """The separator appended to each document: eos, else sep, else nothing."""
    token = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return [] if token is None else [token]


def to_messages(fmt: str, record: dict, row: int, source: str) -> list:
    """A chat/alpaca/sharegpt row as a checked list of {"role", "content"} (strings)."""
    where = f"{source} row {row}"
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise UnusableInput(f"{where}: {key!r} is {_kind(record.get(key))}, not a string")
        extra = record.get("input")
        extra = None if isinstance(extra, float) and extra != extra else extra  # an empty CSV cell reads as NaN
        if extra is not None and not isinstance(extra, str):
            raise UnusableInput(f"{where}: 'input' is {_kind(extra)}, not a string")
        user = record["instruction"] + (f"\n\n{extra}" if extra and extra.strip() else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    key, role_key, text_key = ("messages", "role", "content") if fmt == "chat" else ("conversations", "from", "value")
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise UnusableInput(f"{where}: {key!r} is {'empty' if turns == [] else _kind(turns)}; it must be a "
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
            raise UnusableInput(f"{where}: message {n} ({turn[role_key]}) {text_key!r} is {_kind(turn.get(text_key))}, "
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
    """render_chat_tokens, with a template's own error named by the row that raised it."""
    from jinja2 import TemplateError

    try:
        return render_chat_tokens(messages, tok, source, row)
    except ConfigError:  # dstk's own refusal (UnusableInput included), already naming the row
        raise
    except TemplateError as exc:
        line = f" (template line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise UnusableInput(f"{source} row {row}: the chat template failed{line}: {exc.message or exc}; fix the "
                            "row or the template (--chat-template FILE)") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:  # Python inside Jinja
        raise UnusableInput(f"{source} row {row}: the chat template failed: {type(exc).__name__}: {exc}; fix the "
                            "row or the template (--chat-template FILE)") from None


def render_chat_tokens(messages: list, tok, source: str = "", row: int = 0) -> tuple[list, list]:
    """(input_ids, is_assistant per token) of a conversation rendered with the chat template.

    An assistant turn's characters run from the end of render(messages[:i], add_generation_prompt)
    to the end of render(messages[:i+1]) (its content and end-of-turn marker); both renders must be
    prefixes of the whole conversation's, else the template rewrites earlier turns and is refused.
    Tokens are marked by their character offsets in the one tokenization of the whole text."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tok, messages[:i], generation_prompt=True) if i else ""
        end = _render(tok, messages[: i + 1], generation_prompt=False)
        if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
            raise ConfigError(f"{source} row {row}: the chat template renders turn {i + 1} differently once later "
                              "turns follow (the text of a conversation's start is not a prefix of the whole), so "
                              "the assistant's tokens cannot be found; pass --chat-template FILE with a template "
                              "that keeps earlier turns as they are, or --train-on all")
        spans.append((len(start), len(end)))
    if getattr(tok, "is_fast", False):
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        marks = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
        return enc["input_ids"], marks
    ids, marks, cut = [], [], 0
    for a, b in spans + [(len(full), len(full))]:  # slow tokenizers: tokenize the pieces one by one
        for text, mark in ((full[cut:a], False), (full[a:b], True)):
            piece = tok(text, add_special_tokens=False)["input_ids"] if text else []
            ids, marks = ids + piece, marks + [mark] * len(piece)
        cut = b
    return ids, marks


def _render(tok, messages: list, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
