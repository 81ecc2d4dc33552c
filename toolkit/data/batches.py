"""Rows of packed/padded tokens -> this rank's micro-batches: training order, resume, eval coverage.

Order: epoch e shuffles the N training rows with torch.randperm(N, seed + e), the recipe of
torch's DistributedSampler, and cuts the order into micro-batches of mbs rows; dp rank r takes
micro-batches r, r + dp, r + 2dp, ... (DistributedSampler over a BatchSampler). So global step s is
the micro-batches of perm[s*gbs:(s+1)*gbs] whatever dp and pp are, and no two replicas share a row.
Sharding whole micro-batches, not rows, keeps each micro-batch the same in every layout: packed and
padded rows hold different numbers of targets, so a micro-batch's mean loss depends on its rows.
A batch is ((input_ids, doc_ids), labels), int64 tensors of (mbs, seq_len) (labels (mbs,) for a
classifier): what DeepSpeed's pipeline sends between stages and models.spec.attention_inputs reads.
"""

from dataclasses import dataclass

import numpy as np
import torch

from toolkit.errors import ConfigError
from toolkit.data.formats import IGNORE_INDEX
from toolkit.data.transfer import pin_wanted, pinned


class Rows:
    """Rows of a (memory-mapped) datasets.Dataset, read a batch at a time as int64 tensors: packed rows of
    seq_len (with doc_ids, or compact: pack.features), or documents of the tokens cache (no doc_ids column: unpacked rows, pack.unpacked) truncated and
    padded here to seq_len with `pad_id`, labels -100 on the first token and the padding (a text document's
    labels are its ids)."""

    def __init__(self, ds, seq_len: int | None = None, pad_id: int = 0):
        self.ds = ds.with_format("numpy")
        self.classification = "label" in ds.column_names
        self.compact = "doc_lens" in ds.column_names  # packed rows as the cache keeps them
        self.ragged = not self.compact and "doc_ids" not in ds.column_names
        self.table = ds.with_format("arrow") if self.ragged or self.compact else None
        self.seq_len, self.pad_id = seq_len, pad_id
        if self.ragged and seq_len is None:
            raise ValueError("unpadded rows need the seq_len to pad them to")

    def __len__(self) -> int:
        return len(self.ds)

    def head(self, n: int | None) -> "Rows":
        """The first n rows (all of them when n is None or more)."""
        if n is None or n >= len(self.ds):
            return self
        return Rows(self.ds.select(range(n)).with_format(None), self.seq_len, self.pad_id)

    def batch(self, idx):
        """((input_ids, doc_ids), labels) of rows `idx`: (B, T) int64 each; labels (B,) for classification."""
        idx = [int(i) for i in idx]
        if self.ragged:
            return self._padded(idx)
        if self.compact:
            return self._packed(idx)
        cols = self.ds[idx] if idx else {k: [] for k in self.ds.column_names}
        ids, docs = (torch.as_tensor(cols[k], dtype=torch.long).view(len(idx), -1) for k in ("input_ids", "doc_ids"))
        labels = torch.as_tensor(cols["label" if self.classification else "labels"], dtype=torch.long)
        return (ids, docs), labels.view(len(idx)) if self.classification else labels.view(len(idx), -1)

    def _padded(self, idx: list):
        """Documents truncated to seq_len and padded: ids with pad_id, doc_ids 1 on the row's tokens and 0 after,
        labels -100 on the first token and after."""
        table = self.table[idx] if idx else None
        n, width = len(idx), self.seq_len
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        docs = torch.zeros((n, width), dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        if n:
            mask, take = self._kept(table.column("input_ids").combine_chunks(), width)
            ids[mask], docs[mask] = _values(table, "input_ids", take), 1
            if not self.classification:
                labels[mask] = _values(table, "labels" if "labels" in table.column_names else "input_ids", take)
                labels[:, 0] = IGNORE_INDEX  # no token before the first: its label is never a target
        if self.classification:
            labels = torch.as_tensor(table.column("label").to_numpy() if n else [], dtype=torch.long).view(n)
        return (ids, docs), labels

    def _packed(self, idx: list):
        """Packed rows kept compact: doc_ids 1..k from each row's document lengths (0 on the padding); labels as
        stored, else (text) the ids with -100 on each document's first token and on the padding."""
        n = len(idx)
        if not n:
            empty = torch.zeros((0, self.seq_len), dtype=torch.long)
            return (empty, empty.clone()), empty.clone()
        table = self.table[idx]
        ids = _values(table, "input_ids", None).view(n, -1)
        width = ids.shape[1]
        lens = table.column("doc_lens").combine_chunks()
        counts = np.diff(lens.offsets.to_numpy())
        sizes = lens.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        row = np.repeat(np.arange(n), counts)
        number = np.arange(len(sizes)) - np.repeat(np.cumsum(counts) - counts, counts) + 1  # k-th document of its row
        totals = np.bincount(row, weights=sizes, minlength=n).astype(np.int64)
        docs = torch.zeros((n, width), dtype=torch.long)
        docs[torch.arange(width) < torch.from_numpy(totals)[:, None]] = torch.from_numpy(np.repeat(number, sizes))
        if "labels" in table.column_names:
            labels = _values(table, "labels", None).view(n, -1)
        else:
            labels = ids.clone()
            labels[docs == 0] = IGNORE_INDEX
            first = np.cumsum(sizes) - sizes - np.repeat(np.cumsum(totals) - totals, counts)  # within its row
            labels[torch.from_numpy(row), torch.from_numpy(first)] = IGNORE_INDEX
        return (ids, docs), labels

    @staticmethod
    def _kept(column, width: int):
        """(the (B, width) mask of the tokens kept, their positions in the column's flat values): each row's
        first `width` tokens."""
        offsets = column.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        lengths = np.minimum(np.diff(offsets), width)
        take = np.repeat(offsets[:-1], lengths) + np.arange(int(lengths.sum())) - np.repeat(
            np.cumsum(lengths) - lengths, lengths)
        return torch.arange(width) < torch.from_numpy(lengths)[:, None], take


def _values(table, name: str, take: np.ndarray | None) -> torch.Tensor:
    """Column `name`'s values (at `take`, else all) as int64."""
    flat = table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy((flat if take is None else flat[take]).astype(np.int64))


@dataclass
class TokenData:
    """In-memory rows with Rows' interface (tests). input_ids, doc_ids: (N, T) int64; labels (N, T) or (N,)."""

    input_ids: torch.Tensor
    doc_ids: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, idx):
        idx = torch.as_tensor(idx, dtype=torch.long)
        return (self.input_ids[idx], self.doc_ids[idx]), self.labels[idx]

    def head(self, n: int | None) -> "TokenData":
        """The first n rows (all of them when n is None or more)."""
        return self if n is None else TokenData(self.input_ids[:n], self.doc_ids[:n], self.labels[:n])


class ShardedBatches:
    """Micro-batches of one data-parallel rank: mbs rows each, gas of them per optimizer step.

    Every rank of a dp group (all pipeline stages of one replica) gets the same stream, as
    DeepSpeed's pipeline needs: the first stage reads the inputs, the last stage the labels.
    """

    def __init__(self, data, mbs: int, gas: int, dp: int, dp_rank: int, seed: int):
        unit = getattr(data, "rows_per_item", 1)  # preference pairs (toolkit.data.pairs): 2 rows an item
        self.data, self.gas, self.dp, self.dp_rank, self.seed = data, gas, dp, dp_rank, seed
        self.mbs = mbs // unit  # items (rows, or pairs) per micro-batch
        self.gbs = self.mbs * gas * dp
        self.steps_per_epoch = len(data) // self.gbs  # drop_last: a step never mixes epochs
        if self.steps_per_epoch == 0:
            what = "pairs" if unit == 2 else "rows"
            raise ConfigError(
                f"the training split has {len(data)} {what}, fewer than one global batch "
                f"mbs({mbs}{' rows = ' + str(self.mbs) + ' pairs' if unit == 2 else ''}) * gas({gas}) * dp({dp}) = "
                f"{self.gbs} {what}; add data, lower --seq-len or the batch"
            )

    def epoch_rows(self, epoch: int) -> torch.Tensor:
        """This rank's row indices for an epoch, in order: (steps_per_epoch * mbs * gas,)."""
        g = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's recipe
        perm = torch.randperm(len(self.data), generator=g)[: self.steps_per_epoch * self.gbs]
        return perm.view(-1, self.mbs)[self.dp_rank :: self.dp].reshape(-1)  # (micro-batches, mbs) -> this rank's

    def micro_batches(self, start_step: int = 0, pin_for=None):
        """Endless (inputs, labels) micro-batches from optimizer step start_step on (for resume). pin_for: the
        device they will be copied to; pinned (transfer.pinned) where that is a CUDA one."""
        pin = pin_for is not None and pin_wanted(pin_for)
        epoch, step = divmod(start_step, self.steps_per_epoch)
        first = step * self.gas  # micro-batch index inside the epoch
        while True:
            rows = self.epoch_rows(epoch)
            for k in range(first, self.steps_per_epoch * self.gas):
                batch = self.data.batch(rows[k * self.mbs : (k + 1) * self.mbs])
                yield pinned(batch) if pin else batch
            epoch, first = epoch + 1, 0


def eval_batch_count(n_rows: int, mbs: int, dp: int) -> int:
    """Micro-batches each dp rank runs to cover the whole eval split once (the same on every rank)."""
    return -(-(-(-n_rows // dp)) // mbs)


def eval_micro_batches(data, mbs: int, dp: int, dp_rank: int, count: int | None = None):
    """This rank's share of the eval split (rows r, r + dp, ...) in micro-batches of mbs rows (preference data:
    mbs pairs); the last ones are filled up with rows that carry no loss, so every rank runs eval_batch_count of them
    (or `count`, when a schedule needs more: the extra ones are filler alone)."""
    unit = getattr(data, "rows_per_item", 1)
    mine = list(range(dp_rank, len(data), dp))
    for k in range(count or eval_batch_count(len(data), mbs, dp)):
        idx = mine[k * mbs: (k + 1) * mbs]
        if len(idx) == mbs:
            yield data.batch(idx)
            continue
        (ids, docs), labels = data.batch(idx + [0] * (mbs - len(idx)))  # row 0 stands in for the filler rows
        filler = (torch.arange(mbs) >= len(idx)).repeat_interleave(unit)
        ids[filler], docs[filler] = 0, 1  # one document each: no row is fully masked
        (labels[0] if isinstance(labels, tuple) else labels)[filler] = IGNORE_INDEX
        yield (ids, docs), labels


def loss_weight(labels: torch.Tensor) -> int:
    """How many targets a micro-batch's mean loss averages: tokens t whose labels[t + 1] is not -100
    (the causal shift), or rows whose class label is not -100; preference pairs ((labels, ref_logps)): the
    pairs with a target (their loss is a mean over pairs)."""
    if isinstance(labels, tuple):
        from toolkit.data.pairs.rows import pair_weight

        return pair_weight(labels[0])
    return int((labels[:, 1:] != IGNORE_INDEX).sum()) if labels.dim() == 2 else int((labels != IGNORE_INDEX).sum())
