"""Row formats -> token ids and labels, one example (document) per row; packing comes later.

    text               {"text": ...}                      loss on every token (+ eos)
    prompt-completion  {"prompt", "completion"|"response"} prompt + completion + eos; loss on the completion
    chat               {"messages": [{role, content}]}    the tokenizer's chat template (chat.py); loss on assistant turns
    alpaca             {"instruction", "input"?, "output"} -> chat (user: instruction + input, assistant: output)
    sharegpt           {"conversations": [{from, value}]} -> chat (human/gpt/system -> user/assistant/system)
    classification     {"text", "label": int}             --task classification: one label per row
    preference         {"prompt", "chosen", "rejected"}   --objective dpo: two rows per pair (toolkit.data.pairs)

--train-on all puts the loss on every token instead (prompt and every turn). Labels are -100 where
no loss is taken. An encoder works on a batch of rows (datasets .map(batched=True, with_indices=True))
and refuses a malformed row with the file and its row number.
"""

import itertools
import json

import numpy as np
import pyarrow as pa

from models import task_named
import toolkit.data.tokens as tokens
from toolkit.data.pairs.encode import PAIR_FIELDS, encode_pairs, is_preference
from toolkit.data.chat import (arrow_messages, chat_spans, describe, marks, pieces, plain_messages, renderer,
                               segments, template_errors, to_messages, token_spans, tokens_by_piece)
from toolkit.errors import ConfigError

IGNORE_INDEX = -100  # label value the loss skips (HF and torch cross_entropy convention)
FORMATS = ("text", "prompt-completion", "chat", "alpaca", "sharegpt", "preference")
CHAT_CHUNK = 250  # chat rows rendered while the tokenizer encodes the rows rendered before them


def infer_format(columns, task: str, fmt: str, text_field: str = "text") -> tuple[str, str]:
    """(format, a line saying how it was chosen) from --format and the dataset's columns."""
    columns = set(columns)
    if task_named(task) == "sequence-classification":
        _need(columns, (text_field, "label"), "classification")
        return "classification", f"format classification (--task classification): {text_field!r} and 'label'"
    if fmt != "auto":
        _need(columns, _required(fmt, columns, text_field), fmt)
        return fmt, f"format {fmt} (--format)"
    if is_preference(columns):  # before prompt-completion, whose "prompt" it also holds
        return "preference", "format preference inferred from the columns 'prompt', 'chosen', 'rejected'"
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
            "alpaca": ("instruction", "output"), "preference": PAIR_FIELDS}[fmt]


def _need(columns: set, keys, fmt: str) -> None:
    missing = [k for k in keys if k not in columns]
    if missing:
        raise ConfigError(f"--format {fmt} needs the column(s) {missing}; the data has {sorted(columns)}"
                          + ("; point --text-field at the column that holds the text" if fmt in (
                              "text", "classification") else ""))


class Encoder:
    """A picklable batched map function over Arrow batches (datasets' .map(batched=True, with_indices=True)
    on a dataset formatted "arrow"). Each batch is tokenized by one call of the fast tokenizer (tokens.encode,
    `threads` at once); chat rows are rendered one by one (their Jinja template is Python) while the tokenizer
    encodes the rows rendered before them."""

    def __init__(self, fmt: str, tokenizer, source: str, train_on: str = "assistant", text_field: str = "text",
                 strip: bool = False, threads: int = 1, seq_len: int | None = None):
        self.fmt, self.tok, self.source, self.train_on, self.text_field = fmt, tokenizer, source, train_on, text_field
        self.seq_len = seq_len  # preference rows: a prompt must leave a completion token within it
        self.strip = strip  # plain-text files: a paragraph without its surrounding blank lines
        self.threads = threads
        self.eos = _eos(tokenizer)
        self.progress = None  # a toolkit.data.tokens.Progress, told of each batch (in-process only)
        self.column, self.ahead = None, None  # read_ahead(): the column; (first row, rows or None, what was read)

    def read_ahead(self, ds) -> None:
        """Rows of `ds` (the dataset this encoder maps over, batch after batch in order): while datasets writes a
        batch's output and the next batch is read, the tokenizer already encodes the next batch (text) or its
        first chunk (chat), so no core waits on the single Python thread. Only for a text column of strings
        throughout, or plain chat messages (else each batch's rows are checked, and refused, as they come)."""
        if self.fmt == "chat" and plain_messages(ds.features):  # chat: the next batch's first chunk, rendered
            self.column = ds.data.column("messages")
            return
        column = ds.data.column(self.text_field) if self.fmt == "text" and self.text_field in ds.column_names else None
        if column is not None and column.null_count == 0 and (pa.types.is_string(column.type)
                                                               or pa.types.is_large_string(column.type)):
            self.column = column

    def __getstate__(self) -> dict:
        return {**self.__dict__, "column": None, "ahead": None}  # pickled for another process: no read-ahead

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
        if self.fmt == "preference":  # 2 rows per pair: chosen, rejected
            return encode_pairs(self.tok, batch, indices, self.source, self.seq_len)
        if self.fmt == "prompt-completion":
            ids, labels = self._prompt_completion(batch, indices)
            values, offsets = _flat(ids)
            flat_labels = _flat(labels, np.diff(offsets))[0]
        else:
            values, flat_labels, offsets = self._chat(self._conversations(batch, indices), indices)
        seen = np.concatenate([[0], np.cumsum(flat_labels != IGNORE_INDEX)])
        trained = seen[offsets[1:]] - seen[np.minimum(offsets[:-1] + 1, offsets[1:])]  # not a first token's
        return {"input_ids": tokens.from_flat(values, offsets), "labels": tokens.from_flat(flat_labels, offsets),
                "length": np.diff(offsets), "trained": trained}

    def _text(self, batch, indices: list) -> dict:
        if (ahead := self._ahead(indices)) is not None:
            encoded = ahead.result()  # these rows, read ahead and encoded while the last batch was written
        else:
            encoded = tokens.encode(self.tok, self._texts(self._strings(batch, self.text_field, indices)), self.threads)
        if self.column is not None and (start := indices[-1] + 1) < len(self.column):
            rows = min(len(indices), len(self.column) - start)
            texts = self._texts(self.column.slice(start, rows).to_pylist())
            self.ahead = (start, rows, tokens.submit(self.tok, texts, self.threads))
        values, offsets = _flat([e.ids for e in encoded])
        if self.eos:
            values, offsets = tokens.append(values, offsets, self.eos[0])
        lengths = np.diff(offsets)
        return {"input_ids": tokens.from_flat(values, offsets), "length": lengths,
                "trained": np.maximum(lengths - 1, 0)}

    def _texts(self, texts: list) -> list:
        return [t for t in (t.strip() for t in texts) if t] if self.strip else texts  # blank paragraphs: no document

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

    def _conversations(self, batch, indices: list) -> list:
        """The batch's rows as checked message lists: in Arrow where the messages are plain role/content
        objects, else row by row (to_messages, which refuses a bad row by its number)."""
        if self.fmt == "chat" and isinstance(batch, pa.Table) and (found := arrow_messages(batch.column("messages"))):
            return found
        batch = batch.to_pydict() if isinstance(batch, pa.Table) else batch
        return [to_messages(self.fmt, {k: v[n] for k, v in batch.items()}, row + 1, self.source)
                for n, row in enumerate(indices)]

    def _chat(self, conversations: list, indices: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat ids, flat labels, offsets): rows rendered (Jinja: Python, holding the GIL) CHAT_CHUNK at a time,
        each chunk handed to the tokenizer (its threads, without the GIL) while the next is rendered; the
        tokens that start inside an assistant turn's characters keep their labels. Where the template and the
        tokenizer allow it (chat.Pieces) without character offsets, else from them."""
        render = renderer(self.tok)
        model, split = segments(self.tok, render), pieces(self.tok, render)
        if tokens.backend(self.tok) is None:  # slow tokenizers: no offsets, the pieces one by one
            done = [tokens_by_piece(full, spans, self.tok) for _, full, spans in self._render(conversations, indices, render,
                                                                                             model)]
            values, offsets = _flat([ids for ids, _ in done])
            mask = np.fromiter((m for _, flags in done for m in flags), bool, len(values))
        else:
            chunks = []  # per chunk: (flat ids, offsets, (row, first, last + 1) of its assistant turns)
            ahead = self._ahead(indices)  # the first chunk, read ahead while the last batch was written
            pending, first = ahead if ahead is not None else (None, 0)
            for lo in range(first, len(conversations), CHAT_CHUNK):
                job = self._submit(conversations[lo: lo + CHAT_CHUNK], indices[lo: lo + CHAT_CHUNK], render, model,
                                   split)
                if pending is not None:
                    chunks.append(self._take(*pending, split))
                pending = job  # one chunk in flight: its encodings are freed as soon as read
            self._chat_ahead(indices, render, model, split)
            if pending is not None:
                chunks.append(self._take(*pending, split))
            values, offsets, ranges = _joined(chunks)
            mask = _ranges_mask(ranges, offsets)
        labels = values if self.train_on == "all" else np.where(mask, values, IGNORE_INDEX).astype(np.int32)
        return values, labels, offsets

    def _submit(self, conversations: list, indices: list, render, model, split) -> tuple:
        """Render a chunk and hand it to the tokenizer's thread: (the rendered rows, their Futures)."""
        part = self._render(conversations, indices, render, model, split)
        return (part, tokens.submit(self.tok, [r[1] for r in part if r[0] == "split"], self.threads),
                tokens.submit(self.tok, [r[1] for r in part if r[0] == "whole"], self.threads, offsets=True))

    def _ahead(self, indices: list) -> tuple | None:
        """What was read ahead for these rows (read_ahead), if it is them: a text batch's Future (the same rows),
        or a chat chunk's (job, rows) (rows None: a chunk starting at the first)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or not _contiguous(indices) or ahead[0] != indices[0] or ahead[1] not in (None, len(indices)):
            return None
        return ahead[2]

    def _chat_ahead(self, indices: list, render, model, split) -> None:
        """The next batch's first chunk (read_ahead), rendered and submitted: (its first row, its job, its rows)."""
        start = indices[-1] + 1 if indices else 0
        if self.column is None or not _contiguous(indices) or start >= len(self.column):
            return
        rows = min(CHAT_CHUNK, len(self.column) - start)
        conversations = arrow_messages(self.column.slice(start, rows))
        if conversations:  # else a row the next batch refuses, by its number, when it reaches it
            self.ahead = (start, None, (self._submit(conversations, list(range(start, start + rows)), render, model,
                                                     split), rows))

    def _render(self, rows: list, indices: list, render, model, split=None) -> list:
        """Per row (its messages) ("split", its render, its messages) where `split` finds its assistant tokens
        without offsets, else ("whole", its render, the assistant turns' characters). A template's own error is
        refused naming the row (chat.template_errors)."""
        out, matches = [], split.segments.matches if split is not None else None
        try:
            for messages, n in zip(rows, indices):
                full = render(messages, False) if matches is not None else None
                out.append(("split", full, messages) if full is not None and matches(messages, full) else
                           ("whole", *chat_spans(messages, self.tok, self.source, n + 1, render, model)))
        except Exception:  # noqa: BLE001 - the row's refusal, or the error as it is (template_errors decides)
            with template_errors(self.source, n + 1):
                raise
        return out

    def _take(self, part: list, fast, slow, split) -> tuple:
        """A rendered chunk's (flat token ids, offsets, (row, first, last + 1) of its assistant turns' tokens)."""
        fast, slow = fast.result(), iter(slow.result())
        rows = [r for r in part if r[0] == "split"]
        if rows:
            flat, bounds, found, ranges = split.turns([e.ids for e in fast], [r[2] for r in rows])
            if len(rows) == len(part) and found.all():
                return flat, bounds, ranges  # every row found without offsets (the usual case)
            found = [ranges[ranges[:, 0] == n, 1:].tolist() if ok else None for n, ok in enumerate(found.tolist())]
        ids, turns, found, at = [], [], iter(found if rows else ()), 0
        for kind, full, info in part:
            if kind == "split":
                row_ids, spans = flat[bounds[at]: bounds[at + 1]], next(found)
                at += 1
                if spans is not None:
                    ids.append(row_ids)
                    turns.append(spans)
                    continue  # else: the head tokens or the prompt's do not say: offsets do
                encoding, info = tokens.encode(self.tok, [full], offsets=True)[0], split.segments.spans(info, full)
            else:
                encoding = next(slow)
            spans = token_spans(encoding, info)
            ids.append(encoding.ids)
            turns.append(spans if spans is not None else _runs(marks(encoding.offsets, info)))
        values, offsets = _flat(ids)
        ranges = [(n, a, b) for n, spans in enumerate(turns) for a, b in spans]
        return values, offsets, np.asarray(ranges, np.int64).reshape(-1, 3)

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
        raise ConfigError(f"{self.source} row {indices[bad] + 1}: {key!r} is {describe(values[bad])}, not a string; fix "
                          "the row" + (", or point --text-field at the field that holds the text"
                                       if key == self.text_field else ""))


def _names(batch) -> list:
    return batch.column_names if isinstance(batch, pa.Table) else list(batch)


def _column(batch, key: str, rows: int) -> list:
    """Column `key` of a batch (an Arrow table, or datasets' decoded dict of lists) as Python values."""
    if key not in _names(batch):
        return [None] * rows
    return batch.column(key).to_pylist() if isinstance(batch, pa.Table) else list(batch[key])


def _contiguous(indices: list) -> bool:
    return bool(indices) and indices[-1] == indices[0] + len(indices) - 1


def _flat(rows: list, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """(flat int32 values, offsets from 0) of a list of id lists (or arrays)."""
    if lengths is None:
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(offsets[-1]))
    return values, offsets


def _runs(mask: np.ndarray) -> list:
    """[(first, last + 1)] of each run of True in a boolean array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _joined(chunks: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks of (flat ids, offsets, (row, first, last + 1) ranges) -> the same over all of them."""
    if not chunks:
        return np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros((0, 3), np.int64)
    counts = [len(bounds) - 1 for _, bounds, _ in chunks]
    lengths = np.concatenate([np.diff(bounds) for _, bounds, _ in chunks])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    shift = np.repeat(np.cumsum(counts) - counts, [len(r) for _, _, r in chunks])
    ranges = np.concatenate([r for _, _, r in chunks])
    ranges[:, 0] += shift
    return np.concatenate([flat for flat, _, _ in chunks]), offsets, ranges


def _ranges_mask(ranges: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The flat boolean mask of the ragged rows (cut at `offsets`) that is True on the (row, first, last + 1)
    token ranges."""
    size, start = int(offsets[-1]) + 1, offsets[ranges[:, 0]]
    edges = np.bincount(start + ranges[:, 1], minlength=size) - np.bincount(start + ranges[:, 2], minlength=size)
    return np.cumsum(edges[:-1]) > 0


def _eos(tokenizer) -> list:
    """The separator appended to each document: eos, else sep, else nothing."""
    token = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return [] if token is None else [token]
