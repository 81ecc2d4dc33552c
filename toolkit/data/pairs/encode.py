"""Preference rows -> token rows, as TRL's DPOTrainer tokenizes them (trl 1.16, DPOTrainer._prepare_dataset):

    strings         prompt tokenized alone and prompt + chosen (+ eos, unless it ends with it) as one text, with the
                    tokenizer's special tokens (tok(text)); the completion starts where the two diverge
    conversational  prompt, chosen and rejected as message lists (chosen/rejected continue the prompt): the prompt
                    rendered with the generation prompt, prompt + chosen rendered whole (the chat template)

Each pair gives two rows, chosen then rejected: input_ids = prompt + completion, labels -100 on the prompt. A row is
refused, naming its number, when a field is missing, chosen == rejected, or the prompt leaves no completion token
within --seq-len.
"""

import numpy as np
import pyarrow as pa

import toolkit.data.tokens as tokens
from toolkit.data.chat import describe, renderer, to_messages
from toolkit.errors import UnusableInput

PAIR_FIELDS = ("prompt", "chosen", "rejected")
IGNORE_INDEX = -100  # toolkit.data.formats.IGNORE_INDEX (formats imports this module)


def is_preference(columns) -> bool:
    """Do the columns hold TRL's preference rows (prompt, chosen, rejected)?"""
    return all(k in set(columns) for k in PAIR_FIELDS)


def encode_pairs(tok, batch, indices: list, source: str, seq_len: int | None) -> dict:
    """Columns input_ids, labels, length, trained of 2 rows per pair (chosen, rejected), in pair order."""
    batch = batch.to_pydict() if isinstance(batch, pa.Table) else batch
    rows = [{k: batch.get(k, [None] * len(indices))[n] for k in PAIR_FIELDS} for n in range(len(indices))]
    ids, labels = [], []
    for row, n in zip(rows, indices):
        prompt, chosen, rejected = _pieces(tok, row, n + 1, source)
        plen = min(_common(prompt, chosen), _common(prompt, rejected))
        where = f"{source} row {n + 1}"
        if seq_len is not None and plen >= seq_len:
            raise UnusableInput(f"{where}: the prompt is {plen} tokens, leaving no completion token within --seq-len "
                                f"{seq_len}; raise --seq-len above {plen}, or shorten the prompt")
        for name, full in (("chosen", chosen), ("rejected", rejected)):
            if len(full) <= plen:
                raise UnusableInput(f"{where}: {name!r} adds no token to the prompt; give it a completion")
            ids.append(full)
            labels.append([IGNORE_INDEX] * plen + full[plen:])
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    trained = np.array([sum(t != IGNORE_INDEX for t in lab[1:]) for lab in labels], np.int64)
    return {"input_ids": tokens.list_array(ids), "labels": tokens.list_array(labels), "length": lengths,
            "trained": trained}


def _pieces(tok, row: dict, number: int, source: str) -> tuple[list, list, list]:
    """(prompt ids, prompt + chosen ids, prompt + rejected ids) of a checked row."""
    where = f"{source} row {number}"
    missing = [k for k in PAIR_FIELDS if row[k] is None]
    if missing:
        raise UnusableInput(f"{where}: {missing[0]!r} is missing; a preference row needs 'prompt', 'chosen' and "
                            "'rejected' (strings, or message lists)")
    if row["chosen"] == row["rejected"]:
        raise UnusableInput(f"{where}: 'chosen' and 'rejected' are the same, so the pair prefers nothing; fix or drop "
                            "the row")
    if all(isinstance(row[k], str) for k in PAIR_FIELDS):
        eos = tok.eos_token or ""
        texts = [row["prompt"]] + [row["prompt"] + c + ("" if not eos or c.endswith(eos) else eos)
                                   for c in (row["chosen"], row["rejected"])]
        return tuple(e.ids for e in tokens.encode(tok, texts, special=True))
    if all(isinstance(row[k], list) for k in PAIR_FIELDS):
        prompt = to_messages("chat", {"messages": row["prompt"]}, number, source)
        render = renderer(tok)
        texts = [render(prompt, True)] + [render(prompt + to_messages("chat", {"messages": row[k]}, number, source),
                                                 False) for k in ("chosen", "rejected")]
        return tuple(e.ids for e in tokens.encode(tok, texts))
    kinds = ", ".join(f"{k} {describe(row[k])}" for k in PAIR_FIELDS)
    raise UnusableInput(f"{where}: {kinds}; 'prompt', 'chosen' and 'rejected' must be all strings or all message "
                        "lists ([{'role', 'content'}])")


def _common(a: list, b: list) -> int:
    """The length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
