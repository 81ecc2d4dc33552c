"""Documents (variable-length input_ids + labels) -> rows of exactly seq_len tokens.

Each row carries three int32 lists of seq_len: input_ids, doc_ids (0 padding, 1..k the k-th
document in the row: the contract with models/spec.py attention_inputs) and labels (-100: no loss).

Packing (next fit, in dataset order): a document joins the current row while it fits, else the row
is padded and closed. Labels are -100 on each document's first token, so no token predicts the next
document's first one (the causal loss shifts: position t predicts labels[t + 1]). Without packing
every document is a row of its own, padded. A document longer than seq_len is truncated (default),
dropped (--drop-long), or for packed text cut into seq_len pieces, each a document of its own.
"""

from toolkit.data.formats import IGNORE_INDEX

BATCH = 1000  # documents per packing batch; fixed, so the rows never depend on the machine


def features(seq_len: int, classification: bool = False):
    """The Arrow schema of packed rows (fixed-size lists: numpy batches come out (B, seq_len))."""
    from datasets import Features, Sequence, Value

    row = Sequence(Value("int32"), length=seq_len)
    label = {"label": Value("int64")} if classification else {"labels": row}
    return Features({"input_ids": row, "doc_ids": row, **label})


class Packer:
    """A batched datasets map function: documents in, fixed-length rows out (picklable)."""

    def __init__(self, seq_len: int, pad_id: int, packing: bool, drop_long: bool, split_long: bool):
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.drop_long, self.split_long = drop_long, split_long

    def __call__(self, batch: dict) -> dict:
        out = {"input_ids": [], "doc_ids": [], "labels": []}
        if "label" in batch:  # classification: one padded row per document, never packed
            out = {"input_ids": [], "doc_ids": [], "label": []}
            for ids, label in zip(batch["input_ids"], batch["label"]):
                if len(ids) > self.seq_len and self.drop_long:
                    continue
                self._emit(out, [ids[: self.seq_len]], [[0] * min(len(ids), self.seq_len)])
                out["label"].append(label)
            return out
        row_ids, row_labels = [], []
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            for piece_ids, piece_labels in self.fit(ids, labels):
                if not self.packing or sum(map(len, row_ids)) + len(piece_ids) > self.seq_len:
                    self._emit(out, row_ids, row_labels)
                    row_ids, row_labels = [], []
                row_ids.append(piece_ids)
                row_labels.append([IGNORE_INDEX] + piece_labels[1:])
        self._emit(out, row_ids, row_labels)
        return out

    def fit(self, ids: list, labels: list) -> list:
        """The (ids, labels) pieces one document becomes: itself, truncated, split, or none (dropped,
        or nothing to train on)."""
        n = self.seq_len
        if len(ids) <= n:
            pieces = [(ids, labels)]
        elif self.drop_long:
            pieces = []
        elif self.split_long:
            pieces = [(ids[i: i + n], labels[i: i + n]) for i in range(0, len(ids), n)]
        else:
            pieces = [(ids[:n], labels[:n])]
        return [(i, y) for i, y in pieces if len(i) > 1 and any(t != IGNORE_INDEX for t in y[1:])]

    def _emit(self, out: dict, docs: list, labels: list) -> None:
        """One row from the documents gathered, padded to seq_len; nothing when there are none."""
        if not docs:
            return
        ids = [t for d in docs for t in d]
        doc_ids = [k for k, d in enumerate(docs, 1) for _ in d]
        pad = self.seq_len - len(ids)
        out["input_ids"].append(ids + [self.pad_id] * pad)
        out["doc_ids"].append(doc_ids + [0] * pad)
        if "labels" in out:
            out["labels"].append([t for y in labels for t in y] + [IGNORE_INDEX] * pad)

