"""--streaming: rows read from --data as they are needed (datasets' IterableDataset), never all in memory or cached.

    load_dataset(builder, streaming=True) -> this dp rank's rows (row i goes to dp rank i % dp, as datasets'
    split_dataset_by_node splits a one-file stream; the pipeline stages and tp ranks of one replica read the same
    rows; a resumed rank skips the file's rows before its position unread, by count) -> formats.Encoder and
    pack.Packer on batches of pack.BATCH documents, as the prepared path does -> micro-batches of mbs rows

Order: file order, no shuffle; at the end of its rows a rank starts its share again (the next pass). The
position of a rank, saved with every checkpoint (manifest.save's data_position), is (pass, source rows of its
share before the packing batch it is in, packed rows of that batch already used): a resumed run skips those
rows unread (IterableDataset.skip), packs that batch again (the same documents: the same rows) and drops the
used rows, so it sees the micro-batches the uninterrupted run saw after that step.

Reading, tokenizing and packing run on a thread of their own (transfer.prefetched), AHEAD packing batches ahead:
while the training thread takes one batch's micro-batches, the next one is tokenized, so it waits on the tokenizer
only for the first. A row that fails there is raised on the training thread, as it was.
"""

from pathlib import Path

from toolkit.data.source import BUILDERS, TEXT_SUFFIXES, check_path
from toolkit.errors import ConfigError, UnusableInput

STREAM_BUILDERS = ("text", "json", "parquet")  # what datasets streams from a local file as the prepared path reads it
AHEAD = 2  # packing batches (pack.BATCH documents each) the prefetch thread makes ahead of the micro-batch taken


def check_streamable(data: str, eval_fraction: float, eval_data: str | None, steps: int | None,
                     task: str = "causal-lm") -> None:
    """What --streaming cannot do, refused before any rank starts (train --check), each with its fix."""
    if task == "sequence-classification":
        raise ConfigError("--streaming with --task classification: the head's size (the number of labels) comes "
                          "from reading every row first; drop --streaming")
    path = Path(data)
    if path.is_dir() or BUILDERS.get(path.suffix.lower()) not in STREAM_BUILDERS:
        raise ConfigError(f"--streaming reads .jsonl/.json, .txt/.text/.md and .parquet files; --data {path} is "
                          f"{'a directory' if path.is_dir() else repr(path.suffix or '(no extension)')}: convert it, "
                          "or drop --streaming")
    if eval_fraction > 0 and not eval_data:
        raise ConfigError(f"--eval-fraction {eval_fraction} with --streaming: a stream has no held-out split "
                          "(its documents are read once, in order); pass --eval-data FILE, or --eval-fraction 0")
    if not steps:
        raise ConfigError("--streaming without --steps: the length of an epoch of a stream is unknown before "
                          "it is read; pass --steps N")


def check_rows_for_dp(opts, dp: int) -> None:
    """Refused before any rank starts (train --check) when --data has fewer documents than dp: document i goes to
    dp rank i % dp, so the last ranks would have none. Counts at most dp documents, with the ranks' own reader."""
    if dp > 1:
        have = count_rows(open_stream(opts)[0], dp)
        if have < dp:
            raise UnusableInput(too_few_rows(opts.path, have, dp))


def count_rows(rows, most: int) -> int:
    """The documents of a stream, counted up to `most`."""
    return sum(1 for _ in rows.take(most))


def too_few_rows(path, have: int, dp: int) -> str:
    ranks = f"dp rank {dp - 1}" if have == dp - 1 else f"dp ranks {have}-{dp - 1}"
    return (f"--streaming: --data {path} has {have} document(s) and dp is {dp}: document i goes to dp rank i % dp, "
            f"so {ranks} would have none to read; add documents to --data, or train on at most {max(have, 1)} "
            "data-parallel replicas (fewer processes, or more pp/tp/sp)")


def unreadable(path, exc: Exception) -> UnusableInput:
    """A stream's parse failure as one line: a JSON-lines file's first broken line (as the prepared path says
    it), else the reader's own first line."""
    from toolkit.data.source import diagnose_jsonl

    if Path(str(path)).suffix.lower() in (".jsonl", ".json"):
        diagnose_jsonl(Path(str(path)))  # raises, naming file:line, where a line is broken
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return UnusableInput(f"--streaming: --data {path} cannot be read ({type(exc).__name__}: {first[:200]}); check "
                         "the file, or train without --streaming to have it checked whole first")


def open_stream(opts):
    """(the rows of --data as an IterableDataset, their format, a line saying how it was chosen)."""
    import datasets

    from toolkit.data.formats import infer_format

    path = check_path(opts.path, encoding=opts.encoding)
    builder = BUILDERS[path.suffix.lower()]
    kwargs = {"sample_by": "paragraph", "encoding": opts.encoding} if builder == "text" else {}
    ds = datasets.load_dataset(builder, data_files=str(path.resolve()), split="train", streaming=True, **kwargs)
    try:
        columns = ds.column_names or list(next(iter(ds.take(1)), {}))  # json: known only once a row is read
    except Exception as exc:  # noqa: BLE001  (as in StreamBatches.share)
        raise unreadable(path, exc) from None
    if not columns:
        raise UnusableInput(f"data file {str(path)!r} is empty; it needs text or rows to train on")
    fmt, how = infer_format(columns, opts.task, opts.format, opts.text_field)
    return ds, fmt, how


class StreamBatches:
    """Micro-batches of one dp rank from a stream, with ShardedBatches' interface (mbs, gas, dp, dp_rank,
    micro_batches) and `position`: where the next micro-batch starts (saved in checkpoints, set on resume)."""

    steps_per_epoch = None  # unknown: --streaming needs --steps

    def __init__(self, opts, tokenizer, mbs: int, gas: int, dp: int, dp_rank: int):
        from toolkit.data import pack
        from toolkit.data.formats import Encoder
        from toolkit.data.chat import check_chat_template
        from toolkit.data.prepared import CHAT_FORMATS, check_seq_len, packing_on, pad_id

        check_seq_len(opts)
        self.mbs, self.gas, self.dp, self.dp_rank = mbs, gas, dp, dp_rank
        self.rows, fmt, how = open_stream(opts)
        try:
            empty = next(iter(self.rows.skip(dp_rank).take(1)), None) is None  # this rank's share
        except Exception as exc:  # noqa: BLE001  (as in share)
            raise unreadable(opts.path, exc) from None
        if empty:
            raise UnusableInput(too_few_rows(opts.path, count_rows(self.rows, dp), dp))
        if fmt in CHAT_FORMATS:
            check_chat_template(tokenizer)
        self.encoder = Encoder(fmt, tokenizer, str(opts.path), opts.train_on, opts.text_field,
                               strip=Path(str(opts.path)).suffix.lower() in TEXT_SUFFIXES)
        packing = packing_on(opts, fmt)
        self.packer = pack.Packer(opts.seq_len, pad_id(tokenizer), packing, opts.drop_long,
                                  split_long=packing and fmt == "text")
        self.position = {"pass": 0, "docs": 0, "rows": 0, "dp": dp, "dp_rank": dp_rank}
        self.info = {"streaming": True, "how": how, "format": fmt, "packing": packing, "seq_len": opts.seq_len,
                     "path": str(opts.path)}  # the run's data line and its summary's "data" (+ where it got to)

    def resume_from(self, position: dict) -> None:
        if (position.get("dp"), position.get("dp_rank")) != (self.dp, self.dp_rank):
            raise UnusableInput(f"--resume --streaming: the checkpoint's stream position belongs to dp rank "
                                f"{position.get('dp_rank')} of {position.get('dp')}, this rank is {self.dp_rank} of "
                                f"{self.dp}; resume a streaming run with the data-parallel degree it was saved with")
        self.position = dict(position)

    def share(self, docs: int):
        """This rank's rows (source rows i with i % dp == dp_rank, in file order) after its first `docs`, as pyarrow
        Tables of pack.BATCH rows (the last one shorter): the file's first docs * dp rows are skipped unread."""
        import numpy as np

        from toolkit.data import pack

        batches = self.rows.skip(docs * self.dp).with_format("arrow").iter(batch_size=pack.BATCH * self.dp)
        while True:
            try:
                rows = next(batches)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001  a row the reader cannot parse: named by line, not pyarrow's trace
                raise unreadable(self.encoder.source, exc) from None
            yield rows.take(np.arange(self.dp_rank, rows.num_rows, self.dp))

    def packed(self, p: dict):
        """(pass, docs before the batch, docs after it, first unused row, the batch's packed rows as a pyarrow
        Table) from position `p` on, endless."""
        import pyarrow as pa

        from toolkit.data import pack

        epoch, docs, first, made = p["pass"], p["docs"], p["rows"], 0
        while True:
            read = 0
            for batch in self.share(docs):
                if batch.num_rows == 0:  # a last global batch shorter than dp_rank + 1 rows
                    continue
                tokens = self.encoder(batch, list(range(docs, docs + batch.num_rows)))
                keep = [c for c in ("input_ids", "labels", "label") if c in tokens.column_names]
                table = pa.table(self.packer.columns(tokens.select(keep)))
                if table.num_rows:  # (documents without a token to train on pack into no row)
                    yield epoch, docs, docs + batch.num_rows, first, table
                docs, first, read, made = docs + batch.num_rows, 0, read + batch.num_rows, made + table.num_rows
            if read == 0 and docs == 0:  # refused in __init__ already; a file emptied since
                raise UnusableInput(too_few_rows(self.encoder.source, 0, self.dp))
            if not made and docs == read:  # a whole pass over the share, and not one row to train on
                raise UnusableInput(f"--streaming: --data {self.encoder.source}: none of this rank's {read} documents "
                                    "gives a token to train on (empty texts?); check the file, --format and "
                                    "--text-field")
            epoch, docs, first, made = epoch + 1, 0, 0, 0

    def micro_batches(self, start_step: int = 0, pin_for=None):
        """Endless ((input_ids, doc_ids), labels) micro-batches from self.position (start_step: the resumed
        step, whose position resume_from set); self.position follows the micro-batch last taken. The packing
        batches come from the prefetch thread, up to AHEAD of them (pinned there where pin_for, the device they
        will be copied to, is a CUDA one); a micro-batch is a view of one, or joins two (the only copy)."""
        from toolkit.data.transfer import prefetched

        pending, held = [], 0  # this micro-batch's pieces so far: (columns, first row, end row); their rows
        for epoch, docs, after, first, cols in prefetched(self.columns(dict(self.position)), AHEAD, pin_for):
            n, r = len(cols["input_ids"]), first
            while r < n:
                take = min(self.mbs - held, n - r)
                pending.append((cols, r, r + take))
                held, r = held + take, r + take
                if held < self.mbs:
                    continue  # this packing batch ran out first
                at = (epoch, docs, r) if r < n else (epoch, after, 0)
                self.position = {**self.position, "pass": at[0], "docs": at[1], "rows": at[2]}
                yield _batch(pending)
                pending, held = [], 0

    def columns(self, start: dict):
        """What the prefetch thread makes: (pass, docs before the batch, docs after it, first unused row, {column:
        (rows, seq_len) or (rows, 1) int64 tensor}) per packing batch, from position `start` on, endless."""
        import torch

        for epoch, docs, after, first, table in self.packed(start):
            n = table.num_rows
            yield epoch, docs, after, first, {k: torch.from_numpy(_values(table.column(k)).astype("int64")).view(n, -1)
                                              for k in table.column_names}


def _values(column):
    """The flat values of an Arrow column (fixed-size lists: row after row) as a NumPy array."""
    column = column.combine_chunks()
    return (column.flatten() if hasattr(column, "flatten") else column).to_numpy(zero_copy_only=False)


def _batch(pieces: list):
    """((input_ids, doc_ids), labels) of mbs rows: (mbs, seq_len) int64 each; labels (mbs,) for a classifier.
    pieces: (columns, first row, end row), mbs rows in all: one piece is a view of its packing batch's tensors
    (pinned ones stay pinned), two are joined."""
    import torch

    def rows(k):
        parts = [columns[k][a:b] for columns, a, b in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    labels = rows("labels") if "labels" in pieces[0][0] else rows("label").view(-1)
    return (rows("input_ids"), rows("doc_ids")), labels
