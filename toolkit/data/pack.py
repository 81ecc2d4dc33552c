"""Documents (variable-length input_ids + labels) -> rows of exactly seq_len tokens, a batch at a time in NumPy.

Each packed row carries three int32 lists of seq_len: input_ids, doc_ids (0 padding, 1..k the k-th
document in the row: the contract with models/spec.py attention_inputs) and labels (-100: no loss).
Unpacked rows (one document each) are not written again: `unpacked` picks the documents that make a
row, and batches.Rows reads them from the tokens cache, truncated and padded a micro-batch at a time
(the streaming path pads them here, Packer(packing=False)).

Packing (next fit, in dataset order): a document joins the current row while it fits, else the row
is padded and closed. Labels are -100 on each document's first token, so no token predicts the next
document's first one (the causal loss shifts: position t predicts labels[t + 1]). Without packing
every document is a row of its own, padded. A document longer than seq_len is truncated (default),
dropped (--drop-long), or for packed text cut into seq_len pieces, each a document of its own.
Text documents carry no labels column: their labels are their ids.
"""

import numpy as np
import pyarrow as pa

import toolkit.data.tokens as tokens
from toolkit.data.formats import IGNORE_INDEX

BATCH = 1000  # documents per packing batch; fixed, so the rows never depend on the machine


def features(seq_len: int, classification: bool = False, compact: bool = False, labels: bool = True):
    """The Arrow schema of packed or padded rows (fixed-size lists: numpy batches come out (B, seq_len)); compact
    (the cache's packed rows): each row's document lengths instead of doc_ids, and no labels where they are the
    ids (text: batches.Rows makes both)."""
    from datasets import Features, Sequence, Value

    row = Sequence(Value("int32"), length=seq_len)
    label = {"label": Value("int64")} if classification else {"labels": row} if labels else {}
    docs = {"doc_lens": Sequence(Value("int32"))} if compact else {"doc_ids": row}
    return Features({"input_ids": row, **docs, **label})


def unpacked(docs, seq_len: int, drop_long: bool) -> np.ndarray:
    """The documents of `docs` (a tokens dataset: input_ids, labels or label, length, trained) that are rows of
    their own without packing, as indices: what Packer(packing=False) keeps (a long one truncated to seq_len,
    or dropped with drop_long; a language-model one kept where it has more than one token and a token to
    train on after its first), from the length and trained columns and the labels of the long ones alone."""
    columns = docs.select_columns(["length", "trained"]).with_format("arrow")[:]  # numpy's formatter: 6x slower
    length, trained = (columns.column(k).to_numpy().astype(np.int64) for k in ("length", "trained"))
    long = length > seq_len
    if "label" in docs.column_names:  # classification: every row, truncated
        return np.flatnonzero(~long if drop_long else np.ones(len(length), bool))
    if "labels" not in docs.column_names:  # text: every token after the first is trained
        trained = np.minimum(length, seq_len) - 1
    elif long.any() and not drop_long:  # trained within the first seq_len tokens only: read those documents
        where = np.flatnonzero(long)
        labels, offsets = tokens.ragged(docs.select(where).with_format("arrow")[:].column("labels"))
        seen = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])
        trained[where] = seen[offsets[:-1] + seq_len] - seen[offsets[:-1] + 1]
    keep = (np.minimum(length, seq_len) > 1) & (trained > 0) & ~(long & drop_long)
    return np.flatnonzero(keep)


class Packer:
    """A batched datasets map function over Arrow batches: documents in, fixed-length rows out (picklable)."""

    def __init__(self, seq_len: int, pad_id: int, packing: bool, drop_long: bool, split_long: bool,
                 compact: bool = False):
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.drop_long, self.split_long = drop_long, split_long
        self.compact = compact  # rows as the cache keeps them: doc_lens, labels only where they are not the ids

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.table(self.columns(batch))

    def columns(self, batch: pa.Table) -> dict:
        ids, offsets = tokens.ragged(batch.column("input_ids"))
        if "label" in batch.column_names:  # classification: one padded row per document, never packed
            keep = np.diff(offsets) <= self.seq_len if self.drop_long else np.ones(len(offsets) - 1, bool)
            start, length = offsets[:-1][keep], np.minimum(np.diff(offsets), self.seq_len)[keep]
            rows = self.rows(ids, None, start, length, np.arange(len(start)))
            return {**rows, "label": batch.column("label").combine_chunks().filter(pa.array(keep))}
        own = "labels" in batch.column_names  # else a text document's: its ids
        labels = tokens.ragged(batch.column("labels"))[0] if own else ids
        start, length = self.pieces(offsets, labels)
        return self.rows(ids, labels if own or not self.compact else None, start, length, self.row_of(length))

    def pieces(self, offsets: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first token, length) of the pieces the documents become: each itself, truncated, split, or none
        (dropped, or nothing to train on), in document order."""
        n, length = self.seq_len, np.diff(offsets)
        long = length > n
        count = np.where(long, 0 if self.drop_long else -(-length // n) if self.split_long else 1, 1)
        doc = np.repeat(np.arange(len(length)), count)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(count) - count, count)  # the piece's index in its document
        start = offsets[:-1][doc] + k * n
        size = np.minimum(n, length[doc] - k * n)
        seen = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])
        trained = seen[start + size] - seen[np.minimum(start + 1, start + size)]  # labels after the first token
        keep = (size > 1) & (trained > 0)
        return start[keep], size[keep]

    def row_of(self, length: np.ndarray) -> np.ndarray:
        """The row of each piece: next fit (a loop over pieces, not tokens), or one row each without packing."""
        if not self.packing:
            return np.arange(len(length))
        row, used, out = -1, self.seq_len + 1, np.empty(len(length), np.int64)
        for k, size in enumerate(length.tolist()):
            if used + size > self.seq_len:
                row, used = row + 1, 0
            out[k], used = row, used + size
        return out

    def rows(self, ids, labels, start, length, row) -> dict:
        """Fixed-size rows holding the pieces (start, length) at `row`, in order, padded."""
        n, count = self.seq_len, int(row[-1]) + 1 if len(row) else 0
        first = np.flatnonzero(np.diff(row, prepend=-1))  # each row's first piece
        place = np.zeros(len(row), np.int64)  # each piece's offset within its row
        ends = np.cumsum(length)
        if len(row):
            place = ends - length - np.repeat(ends[first] - length[first], np.diff(np.append(first, len(row))))
        piece = np.repeat(np.arange(len(row)), length)  # per token of the output
        within = np.arange(int(ends[-1]) if len(row) else 0) - np.repeat(ends - length, length)
        src, dest = start[piece] + within, (row * n + place)[piece] + within
        out_ids = np.full(count * n, self.pad_id, np.int32)
        out_ids[dest] = ids[src]
        if self.compact:
            lens = pa.ListArray.from_arrays(pa.array(np.append(first, len(row)), pa.int32()),
                                            pa.array(length, pa.int32()))
            out = {"input_ids": _rows(out_ids, n), "doc_lens": lens}
        else:
            doc_ids = np.zeros(count * n, np.int32)
            doc_ids[dest] = (np.arange(len(row)) - np.repeat(first, np.diff(np.append(first, len(row)))) + 1)[piece]
            out = {"input_ids": _rows(out_ids, n), "doc_ids": _rows(doc_ids, n)}
        if labels is not None:
            out_labels = np.full(count * n, IGNORE_INDEX, np.int32)
            out_labels[dest] = np.where(within == 0, IGNORE_INDEX, labels[src])
            out["labels"] = _rows(out_labels, n)
        return out


def _rows(values: np.ndarray, n: int) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values), n)
