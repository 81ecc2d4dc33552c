"""A batch of strings -> token ids, at the tokenizer's own speed; ragged ids <-> Arrow list arrays.

    encode(tok, texts, threads)   the fast tokenizer's encode_batch: its own thread pool, or where
                                  TOKENIZERS_PARALLELISM=false turns that off (dstk's ranks), `threads` slices
                                  of the batch at once (it releases the GIL: the threads run in parallel)
    submit(tok, texts, ...)       encode() in a background thread (a Future): the caller goes on with Python
                                  work (rendering the next chat rows) while the tokenizer runs
    ragged / list_array           list-of-lists <-> (flat int32 values, int64 offsets) <-> pyarrow ListArray
    Progress                      the preparing rank's progress line (below)

Everything after the tokenizer works on whole batches in NumPy or Arrow: no loop over tokens in Python.
"""

from concurrent.futures import ThreadPoolExecutor

import os
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_PLAIN: dict = {}  # id(backend) -> (backend, a copy without truncation and padding)
_POOLS: dict = {}  # (process id, threads) -> ThreadPoolExecutor (a forked process makes its own)


def backend(tok):
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer, else None (slow tokenizers); without the truncation
    or padding a tokenizer.json may carry (the HF tokenizer turns them off for a call like dstk's, too)."""
    engine = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if engine is None or (engine.truncation is None and engine.padding is None):
        return engine
    if id(engine) not in _PLAIN:
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(engine.to_str())
        plain.no_truncation()
        plain.no_padding()
        _PLAIN[id(engine)] = (engine, plain)  # the original kept alive: its id stays its own
    return _PLAIN[id(engine)][1]


def encode(tok, texts: list, threads: int = 1, special: bool = False, offsets: bool = False) -> list:
    """tokenizers.Encoding objects (fast tokenizers) of `texts`: one batched call where the tokenizer's own
    threads are on, else the batch cut into `threads` slices encoded at once; slow tokenizers: objects
    with .ids, one batched call."""
    engine = backend(tok)
    if engine is None:
        out = tok(texts, add_special_tokens=special)
        return [_Slow(ids) for ids in out["input_ids"]]
    call = engine.encode_batch if offsets else engine.encode_batch_fast  # _fast: no character offsets
    if threads <= 1 or len(texts) < 2 * threads or own_threads():
        return call(texts, add_special_tokens=special)
    step = -(-len(texts) // threads)
    parts = _pool(threads).map(lambda i: call(texts[i: i + step], add_special_tokens=special),
                               range(0, len(texts), step))
    return [e for part in parts for e in part]


def submit(tok, texts: list, threads: int = 1, special: bool = False, offsets: bool = False):
    """encode(...) run by a background thread (one per process, so submitted batches come back in order): a
    Future of its list of encodings. The tokenizer releases the GIL while it works."""
    return _pool(1, "dstk-encode").submit(encode, tok, texts, threads, special, offsets)


def _pool(threads: int, name: str = "dstk-tokenize") -> ThreadPoolExecutor:
    key = (os.getpid(), threads, name)
    return _POOLS.get(key) or _POOLS.setdefault(key, ThreadPoolExecutor(threads, name))


def own_threads() -> bool:
    """Does the tokenizer spread a batch over its own thread pool here? (tokenizers' rule for the variable; it
    turns it off in processes forked after the pool was used)"""
    value = os.environ.get("TOKENIZERS_PARALLELISM", "true").strip().lower()
    return value not in ("", "off", "false", "f", "no", "n", "0")


class _Slow:
    def __init__(self, ids):
        self.ids = ids


def list_array(rows: list, dtype=pa.int32()) -> pa.ListArray:
    """A list of int lists as an Arrow ListArray (pyarrow converts it in C)."""
    return pa.array(rows, type=pa.list_(dtype))


def from_flat(values: np.ndarray, offsets: np.ndarray) -> pa.ListArray:
    """The ListArray of `values` cut at `offsets` (len(rows) + 1 of them, from 0)."""
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values))


def ragged(column) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets from 0) of an Arrow list column (a ChunkedArray or a ListArray, sliced or not)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return column.flatten().to_numpy(zero_copy_only=False), offsets


def append(values: np.ndarray, offsets: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
    """`token` appended to every row of a ragged array (the end-of-text after each document)."""
    out = np.insert(values, offsets[1:], token)
    return out, offsets + np.arange(len(offsets))


# What a long data preparation is doing, for the rank that does it (the others wait, without a timeout):
#
#     preparing --data: tokenizing train.jsonl: 120,000 / 1,600,000 rows (7.5%), 41,000 rows/s, 9.1 M tokens/s, ETA 36 s
#
# rewritten in place about twice a second on a terminal; in a log file (stderr not a terminal) a line every
# DSTK_PROGRESS_SECONDS seconds (default 30), and one when done.
EVERY = 30.0  # seconds between lines in a log file


class Progress:
    def __init__(self, what: str, total: int, stream=None, every: float | None = None):
        self.what, self.total, self.stream = what, total, stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every = 0.5 if self.tty else float(os.environ.get("DSTK_PROGRESS_SECONDS", EVERY) if every is None
                                                  else every)
        self.start = self.last = time.monotonic()
        self.rows = self.tokens = 0

    def update(self, rows: int, tokens: int) -> None:
        """`rows` more rows read, `tokens` more tokens made."""
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._write(self.line(now))

    def line(self, now: float) -> str:
        seconds = max(now - self.start, 1e-9)
        rate = self.rows / seconds
        eta = (self.total - self.rows) / rate if rate else float("inf")
        share = f" ({100 * self.rows / self.total:.1f}%)" if self.total else ""
        return (f"{self.what}: {self.rows:,} / {self.total:,} rows{share}, {rate:,.0f} rows/s, "
                f"{self.tokens / seconds / 1e6:.2f} M tokens/s, ETA {_duration(eta)}")

    def close(self) -> None:
        seconds = time.monotonic() - self.start
        self._write(f"{self.what}: {self.rows:,} rows, {self.tokens:,} tokens in {seconds:.1f} s "
                    f"({self.rows / max(seconds, 1e-9):,.0f} rows/s)")
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str) -> None:
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s" if minutes else \
        f"{secs} s"
