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

import itertools
import json
from operator import itemgetter

import numpy as np
import pyarrow as pa

from models import task_named
import toolkit.data.tokens as tokens
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
    """A picklable batched map function over Arrow batches (datasets' .map(batched=True, with_indices=True)
    on a dataset formatted "arrow"; it may run in num_proc worker processes). Each batch is tokenized by
    one call of the fast tokenizer (tokens.encode, `threads` at once); only chat rows are rendered one by
    one (their Jinja template is Python)."""

    def __init__(self, fmt: str, tokenizer, source: str, train_on: str = "assistant", text_field: str = "text",
                 strip: bool = False, threads: int = 1):
        self.fmt, self.tok, self.source, self.train_on, self.text_field = fmt, tokenizer, source, train_on, text_field
        self.strip = strip  # plain-text files: a paragraph without its surrounding blank lines
        self.threads = threads
        self.eos = _eos(tokenizer)
        self.progress = None  # a toolkit.data.progress.Progress, told of each batch (in-process only)

    def __call__(self, batch, indices: list) -> pa.Table:
        """Columns input_ids, labels (not for text: its labels are its ids) or label, length (tokens) and
        trained (tokens with a loss)."""
        out = pa.table(self.columns(batch, indices))
        if self.progress is not None:
            self.progress.update(len(indices), len(out["input_ids"].combine_chunks().values))
        return out

    def columns(self, batch, indices: list) -> dict:
        """batch: an Arrow table where every column is a plain Arrow value, else datasets' decoded dict (its
        Json columns, e.g. chat messages whose turns differ in keys, are JSON strings in Arrow)."""
        if self.fmt == "text":
            return self._text(batch, indices)
        if self.fmt == "classification":
            return self._classification(batch, indices)
        if self.fmt == "prompt-completion":
            ids, labels = self._prompt_completion(batch, indices)
        else:
            ids, labels = self._chat(batch.to_pydict() if isinstance(batch, pa.Table) else batch, indices)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat_labels, offsets = _flat(labels, lengths)
        seen = np.concatenate([[0], np.cumsum(flat_labels != IGNORE_INDEX)])
        trained = seen[offsets[1:]] - seen[np.minimum(offsets[:-1] + 1, offsets[1:])]  # not a first token's
        return {"input_ids": tokens.list_array(ids), "labels": tokens.from_flat(flat_labels, offsets),
                "length": lengths, "trained": trained}

    def _text(self, batch, indices: list) -> dict:
        texts = self._strings(batch, self.text_field, indices)
        if self.strip:  # whitespace between paragraphs is no document
            texts = [t for t in (t.strip() for t in texts) if t]
        values, offsets = _flat([e.ids for e in tokens.encode(self.tok, texts, self.threads)])
        if self.eos:
            values, offsets = tokens.append(values, offsets, self.eos[0])
        lengths = np.diff(offsets)
        return {"input_ids": tokens.from_flat(values, offsets), "length": lengths,
                "trained": np.maximum(lengths - 1, 0)}

    def _prompt_completion(self, batch, indices: list) -> tuple[list, list]:
        answer_key = "completion" if "completion" in _names(batch) else "response"
        prompts = tokens.encode(self.tok, self._strings(batch, "prompt", indices), self.threads)
        answers = tokens.encode(self.tok, self._strings(batch, answer_key, indices), self.threads)
        ids, labels = [], []
        for prompt, answer in zip(prompts, answers):
            prompt, answer = prompt.ids, answer.ids + self.eos
            ids.append(prompt + answer)
            labels.append((prompt if self.train_on == "all" else [IGNORE_INDEX] * len(prompt)) + answer)
        return ids, labels

    def _chat(self, batch: dict, indices: list) -> tuple[list, list]:
        """Rendered row by row (Jinja), tokenized in one batch; tokens marked by their character offsets."""
        render = renderer(self.tok)
        rendered = [chat_spans(to_messages(self.fmt, {k: v[n] for k, v in batch.items()}, row + 1, self.source),
                               self.tok, self.source, row + 1, render) for n, row in enumerate(indices)]
        if tokens.backend(self.tok) is None:  # slow tokenizers: no offsets, the pieces one by one
            out = [tokens_by_piece(full, spans, self.tok) for full, spans in rendered]
        else:
            encoded = tokens.encode(self.tok, [full for full, _ in rendered], self.threads, offsets=True)
            out = [(e.ids, marks(e.offsets, spans)) for e, (_, spans) in zip(encoded, rendered)]
        every = self.train_on == "all"
        return [ids for ids, _ in out], [ids if every else np.where(m, ids, IGNORE_INDEX).tolist() for ids, m in out]

    def _classification(self, batch, indices: list) -> dict:
        texts = self._strings(batch, self.text_field, indices)
        labels = _column(batch, "label", len(indices))
        for label, row in zip(labels, indices):
            if not isinstance(label, int) or isinstance(label, bool) or label < 0:
                raise ConfigError(f"{self.source} row {row + 1}: 'label' is {json.dumps(label)[:40]}; classification "
                                  "rows need an integer 'label' >= 0 (a class index)")
        ids = [e.ids for e in tokens.encode(self.tok, texts, self.threads, special=True)]
        return {"input_ids": tokens.list_array(ids), "label": labels, "length": [len(i) for i in ids],
                "trained": [1] * len(ids)}

    def _strings(self, batch, key: str, indices: list) -> list:
        """Column `key` of an Arrow batch as Python strings; a row that holds no string is refused."""
        column = batch.column(key) if isinstance(batch, pa.Table) and key in batch.column_names else None
        if column is not None and column.null_count == 0 and (pa.types.is_string(column.type)
                                                               or pa.types.is_large_string(column.type)):
            return column.to_pylist()
        values = _column(batch, key, len(indices))
        bad = next((k for k, v in enumerate(values) if not isinstance(v, str)), None)
        if bad is None:
            return values
        raise ConfigError(f"{self.source} row {indices[bad] + 1}: {key!r} is {_kind(values[bad])}, not a string; fix "
                          "the row" + (", or point --text-field at the field that holds the text"
                                       if key == self.text_field else ""))


def _names(batch) -> list:
    return batch.column_names if isinstance(batch, pa.Table) else list(batch)


def _column(batch, key: str, rows: int) -> list:
    """Column `key` of a batch (an Arrow table, or datasets' decoded dict of lists) as Python values."""
    if key not in _names(batch):
        return [None] * rows
    return batch.column(key).to_pylist() if isinstance(batch, pa.Table) else list(batch[key])


def _flat(rows: list, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """(flat int32 values, offsets from 0) of a list of id lists (or arrays)."""
    if lengths is None:
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(offsets[-1]))
    return values, offsets


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
