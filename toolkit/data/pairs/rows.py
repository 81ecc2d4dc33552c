"""Pairs: prepared preference rows read a pair at a time. Pair i is rows 2i (chosen) and 2i + 1 (rejected) of the
rows dataset (encode.py's order), so the shuffles, the dp shards and the micro-batches of toolkit.data.batches deal
whole pairs: a micro-batch of mbs rows holds mbs / 2 pairs, each pair's rows adjacent (chosen at even positions).

A batch is ((input_ids, doc_ids), (labels, ref_logps)): the rows as toolkit.data.batches.Rows pads them (B, T) int64,
and the reference model's log-probability of each row's completion (B,) float32 (zeros until they are known:
toolkit.train.preference.reference fills them; a LoRA run at pp 1 computes them live instead).
"""

import torch

IGNORE_INDEX = -100


class Pairs:
    """The pairs of `rows` (a toolkit.data.batches.Rows of 2N rows, chosen then rejected), with `ref` (2N,) float32
    reference log-probs per row, or None (zeros)."""

    rows_per_item = 2  # what batches.ShardedBatches and eval_micro_batches count a micro-batch's items in

    def __init__(self, rows, ref: torch.Tensor | None = None):
        if len(rows) % 2:
            raise ValueError(f"preference rows come in pairs; got {len(rows)} rows")
        self.rows, self.ref = rows, ref

    def __len__(self) -> int:
        return len(self.rows) // 2

    @property
    def seq_len(self) -> int:
        return self.rows.seq_len

    def head(self, n: int | None) -> "Pairs":
        """The first n pairs (all of them when n is None or more)."""
        if n is None or n >= len(self):
            return self
        return Pairs(self.rows.head(2 * n), None if self.ref is None else self.ref[: 2 * n])

    def with_reference(self, ref: torch.Tensor) -> "Pairs":
        if ref.shape != (len(self.rows),):
            raise ValueError(f"reference log-probs for {len(self.rows)} rows expected, got {tuple(ref.shape)}")
        return Pairs(self.rows, ref.float())

    def batch(self, idx):
        """((input_ids, doc_ids), (labels, ref_logps)) of pairs `idx`: 2 len(idx) rows, each pair's adjacent."""
        rows = pair_rows(idx)
        inputs, labels = self.rows.batch(rows)
        ref = torch.zeros(len(rows)) if self.ref is None else self.ref[torch.as_tensor(rows, dtype=torch.long)]
        return inputs, (labels, ref)


def pair_rows(idx) -> list:
    """Row indices [2i, 2i + 1, ...] of pairs `idx`."""
    return [r for i in idx for r in (2 * int(i), 2 * int(i) + 1)]


def pair_weight(labels: torch.Tensor) -> int:
    """Pairs in a micro-batch that carry a loss (labels (B, T), chosen rows at even positions): an eval micro-batch's
    filler pairs have none."""
    return int((labels[0::2, 1:] != IGNORE_INDEX).any(dim=1).sum())
