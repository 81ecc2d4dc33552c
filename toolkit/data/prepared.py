"""--data -> memory-mapped rows of seq_len tokens, split by document, sharded per data-parallel rank.

    load (source.py) -> tokenize (formats.py: a batch per call of the fast tokenizer, its threads; tokens.py)
    -> split by document (--eval-fraction, or --eval-data) -> pack or pad (pack.py: NumPy over whole batches)

Every step is a HF `datasets` map whose Arrow output is cached under --data-cache (default
HF_DATASETS_CACHE) with a fingerprint of what changes tokens (the file, the tokenizer's files, the chat
template, the format, seq-len, packing, train-on) and nothing else: a second run with the same inputs
reads the cache. One rank per node (per shared file system) builds it, saying how far it is
(tokens.Progress); the others wait for it with no timeout, then memory-map it. No rank holds more than the memory-mapped rows and the batch it is building.

Batches and their order: toolkit.data.batches (re-exported here, and by the package: `from toolkit import data`).
"""

import gc
import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import ConfigError
from toolkit.data import fingerprint, pack
from toolkit.data.batches import (Rows, ShardedBatches, TokenData, eval_batch_count,
                                        eval_micro_batches, loss_weight)
from toolkit.data.chat import check_chat_template, plain_messages
from toolkit.data.formats import IGNORE_INDEX, Encoder, infer_format
from toolkit.data.tokens import Progress
from toolkit.data.source import TEXT_SUFFIXES, cache_root, check_path, check_text, decode_text, load, seq_len_fits

__all__ = ["DataOptions", "Prepared", "prepare", "prepare_once_per_node", "split_documents", "pad_id",  # the API
           "Rows", "TokenData", "ShardedBatches", "eval_batch_count", "eval_micro_batches", "loss_weight",
           "IGNORE_INDEX", "check_path", "check_text", "decode_text", "load"]
VERSION = 6  # bump when the tokenized or packed rows change for the same inputs (invalidates caches)
CHAT_FORMATS = ("chat", "alpaca", "sharegpt")
TOKENIZE_BATCH = 2000  # documents per tokenizer call (the rows do not depend on it)


@dataclass
class DataOptions:
    path: str
    seq_len: int
    task: str = "causal-lm"  # or "sequence-classification" (models.TASKS; "classification" is read as it)
    format: str = "auto"  # formats.FORMATS, or auto: from the columns
    text_field: str = "text"
    train_on: str = "assistant"  # or "all": loss on prompts and every turn too
    packing: bool | None = None  # None: on for text, off for supervised formats; never for classification
    drop_long: bool = False  # drop documents longer than seq_len instead of truncating them
    eval_fraction: float = 0.05
    eval_data: str | None = None  # a file for evaluation instead of a share of --data
    seed: int = 1234
    encoding: str = "utf-8"
    cache_dir: str | None = None  # None: HF_DATASETS_CACHE
    workers: int | None = None  # tokenizing threads; None: the cores, at most 8
    max_positions: int | None = None  # the model's, checked against seq_len


@dataclass
class Prepared:
    train: "Rows"
    eval: "Rows"
    info: dict  # what was read, inferred, truncated and dropped (logged by the loop)

    def message(self) -> str:
        i = self.info
        if i.get("streaming"):  # read as the steps need it: no counts ahead
            return (f"data: --streaming {i['path']}: {i['how']}; rows read as the steps need them (dp rank r reads "
                    f"documents i % dp == r), {'packed' if i['packing'] else 'padded'} into rows of {i['seq_len']} "
                    f"tokens; eval: {i['eval_rows']} rows" + (" of --eval-data" if i["eval_rows"] else ""))
        if i.get("pairs"):  # preference rows: 2 rows a pair
            return (f"data: {i['how']}; {i['documents']} pairs -> {i['train_documents']} train / {i['eval_documents']} "
                    f"eval ({i['split']}); 2 rows a pair (chosen, rejected) of {i['seq_len']} tokens, padded; "
                    f"{i['long']} rows longer than --seq-len truncated")
        return (f"data: {i['how']}; {i['documents']} documents -> {i['train_documents']} train / "
                f"{i['eval_documents']} eval ({i['split']}); {i['train_rows']} train / {i['eval_rows']} eval rows of "
                f"{i['seq_len']} tokens ({'packed' if i['packing'] else 'padded'}); {i['long']} longer than --seq-len "
                f"{i['long_policy']}; {i['untrained']} without a token to train on, dropped")


def prepare(opts: DataOptions, tokenizer, quiet: bool = False) -> Prepared:
    """Load, tokenize, split and pack (or pad) --data; cached by fingerprint. Tokenizing reports its progress
    on stderr (toolkit.data.tokens.Progress) unless `quiet`."""
    with _heap_frozen():
        return _prepare(opts, tokenizer, quiet)


@contextmanager
def _heap_frozen():
    """The objects alive before preparing (torch, transformers, the model: millions) left out of the garbage
    collector's passes while it runs: tokenizing makes a container object per message and token list, enough
    to set off full collections of the whole heap (0.1-0.2 s each, on the thread every tokenizer call waits
    for). Objects made while preparing are collected as usual. Not where the caller froze objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)  # the young garbage first (cheap): frozen, a cycle would be held until after preparing
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _prepare(opts: DataOptions, tokenizer, quiet: bool) -> Prepared:
    check_seq_len(opts)
    if not 0 <= opts.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction must be in [0, 1), got {opts.eval_fraction}")
    ds = load(opts.path, opts.encoding, opts.cache_dir)
    fingerprint.of_input(opts.path, opts.cache_dir)  # hashed here, by the preparing rank: the others read its record
    fmt, how = infer_format(ds.column_names, opts.task, opts.format, opts.text_field)
    if fmt in CHAT_FORMATS:
        check_chat_template(tokenizer)
    packing = packing_on(opts, fmt)
    tokens = _tokenize(ds, fmt, opts, tokenizer, opts.path, quiet)
    if fmt == "preference":
        return _prepare_pairs(tokens, opts, tokenizer, how, quiet)
    if opts.eval_data:
        held = load(opts.eval_data, opts.encoding, opts.cache_dir, flag="--eval-data")
        fingerprint.of_input(opts.eval_data, opts.cache_dir)
        infer_format(held.column_names, opts.task, fmt, opts.text_field)  # the same format's columns
        held = _tokenize(held, fmt, opts, tokenizer, opts.eval_data, quiet)
        parts, split = ((tokens, np.arange(len(tokens))), (held, np.arange(len(held)))), "--eval-data"
    else:
        parts = tuple((tokens, idx) for idx in split_indices(len(tokens), opts.eval_fraction, opts.seed))
        split = f"--eval-fraction {opts.eval_fraction}, seed {opts.seed}"
    chosen = {}  # unpacked rows: per tokens dataset, which of its documents make a row
    train, eval_ = (_pack(docs, idx, opts, tokenizer, packing, fmt, name, chosen) for (docs, idx), name in zip(
        parts, ("train", "eval")))
    if len(train) == 0:
        raise ConfigError(f"{opts.path}: no row to train on after tokenizing ({len(tokens)} documents; none has "
                          "a token with a loss within --seq-len); check --format, --train-on and --seq-len")
    info = {"how": how, "format": fmt, "packing": packing, "seq_len": opts.seq_len, "documents": len(tokens),
            "train_documents": len(parts[0][1]), "eval_documents": len(parts[1][1]), "split": split,
            "train_rows": len(train), "eval_rows": len(eval_), **_stats([tokens, held] if opts.eval_data else [tokens], opts, packing, fmt)}
    if fmt == "classification":  # the head's size: the largest class index seen, + 1
        info["num_labels"] = max(int(d.with_format("numpy", columns=["label"])[:]["label"].max()) for d in (train, eval_)
                                 if len(d)) + 1
    return Prepared(Rows(train, opts.seq_len, pad_id(tokenizer)), Rows(eval_, opts.seq_len, pad_id(tokenizer)), info)


def _prepare_pairs(tokens, opts: DataOptions, tokenizer, how: str, quiet: bool) -> Prepared:
    """Preference rows (2 per pair: toolkit.data.pairs): split by pair (--eval-fraction, or --eval-data), each row
    padded to seq_len as it is read (batches.Rows), every row kept (a pair is never cut in two)."""
    from toolkit.data.pairs import Pairs

    def rows(docs, pairs):
        picked = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
        return Rows(docs.select(picked).select_columns(["input_ids", "labels"]), opts.seq_len, pad_id(tokenizer))

    n = len(tokens) // 2
    if opts.eval_data:
        held = load(opts.eval_data, opts.encoding, opts.cache_dir, flag="--eval-data")
        fingerprint.of_input(opts.eval_data, opts.cache_dir)
        infer_format(held.column_names, opts.task, "preference", opts.text_field)
        held = _tokenize(held, "preference", opts, tokenizer, opts.eval_data, quiet)
        train, eval_ = rows(tokens, np.arange(n)), rows(held, np.arange(len(held) // 2))
        split, held_pairs = "--eval-data", len(held) // 2
    else:
        train_idx, eval_idx = split_indices(n, opts.eval_fraction, opts.seed)
        train, eval_ = rows(tokens, train_idx), rows(tokens, eval_idx)
        split, held_pairs = f"--eval-fraction {opts.eval_fraction}, seed {opts.seed}", 0
    info = {"how": how, "format": "preference", "packing": False, "seq_len": opts.seq_len, "documents": n + held_pairs,
            "train_documents": len(train) // 2, "eval_documents": len(eval_) // 2, "split": split + " (by pair)",
            "train_rows": len(train), "eval_rows": len(eval_), "pairs": True,
            **_stats([tokens] + ([held] if opts.eval_data else []), opts, False, "preference")}
    return Prepared(Pairs(train), Pairs(eval_), info)


def check_seq_len(opts: DataOptions) -> None:
    seq_len_fits(opts.seq_len, opts.max_positions)


def packing_on(opts: DataOptions, fmt: str) -> bool:
    if fmt == "preference":
        if opts.packing:
            raise ConfigError("--packing with preference rows: each pair's rows are scored as whole sequences "
                              "(--objective dpo); drop --packing")
        return False
    if fmt == "classification":
        if opts.packing:
            raise ConfigError("--packing does not apply to --task classification (one label per row); drop it")
        return False
    return fmt == "text" if opts.packing is None else opts.packing


def _tokenize(ds, fmt: str, opts: DataOptions, tokenizer, source, quiet: bool = False):
    """One row of (input_ids, labels | label, length, trained) per document, cached; tokenized in this process
    by `workers` tokenizer threads (chat rows: rendered while the tokenizer encodes the rows before them), with
    dstk's progress line."""
    import datasets

    encoder = Encoder(fmt, tokenizer, str(source), opts.train_on, opts.text_field,
                      strip=Path(str(source)).suffix.lower() in TEXT_SUFFIXES, threads=workers(opts),
                      seq_len=opts.seq_len if fmt == "preference" else None)
    key = _fingerprint(ds._fingerprint, fmt, opts.train_on if fmt != "text" else None,
                       opts.text_field if fmt in ("text", "classification") else None,
                       tokenizer_fingerprint(tokenizer, chat=fmt in CHAT_FORMATS or fmt == "preference"),
                       *([opts.seq_len] if fmt == "preference" else []))  # its refusals depend on seq_len
    bars = datasets.utils.logging.is_progress_bar_enabled()
    if not quiet:
        encoder.progress = Progress(f"preparing --data: tokenizing {Path(str(source)).name}", len(ds))
    encoder.read_ahead(ds)
    datasets.disable_progress_bars()
    try:
        plain = all(isinstance(f, datasets.Value) for f in ds.features.values()) or (  # else decoded by datasets
            fmt == "chat" and plain_messages(ds.features))
        tokens = ds.with_format("arrow" if plain else None).map(
            encoder, batched=True, with_indices=True, remove_columns=ds.column_names, batch_size=TOKENIZE_BATCH,
            new_fingerprint=key, cache_file_name=_cache_file(opts, f"tokens-{key}"),
            desc=f"Tokenizing {Path(str(source)).name}")
    finally:
        if bars:
            datasets.enable_progress_bars()
    if encoder.progress is not None and encoder.progress.rows:
        encoder.progress.close()
    return tokens.with_format(None)


def workers(opts: DataOptions) -> int:
    """Tokenizer threads: --data-workers, else the cores (at most 8)."""
    return opts.workers or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                               os.cpu_count() or 1)


def split_documents(tokens, eval_fraction: float, seed: int):
    """(train, eval) documents: split_indices' of `tokens`."""
    return tuple(tokens.select(idx) for idx in split_indices(len(tokens), eval_fraction, seed))


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices of n: a seeded shuffle, the first ceil(n * eval_fraction) go to eval; each
    side keeps file order (training shuffles its rows every epoch)."""
    n_eval = min(n - 1, -int(-n * eval_fraction // 1)) if eval_fraction > 0 else 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_eval:].sort().values.numpy(), perm[:n_eval].sort().values.numpy()


def _pack(docs, idx: np.ndarray, opts: DataOptions, tokenizer, packing: bool, fmt: str, name: str,
          chosen: dict):
    """The documents `idx` of `docs` as packed rows (cached); unpacked: the documents that make a row, read from
    the tokens cache (batches.Rows truncates and pads them), chosen once over all of `docs` (its columns read as
    they lie, not gathered through the split's indices; `chosen` keeps the choice for the other split)."""
    if not packing:
        keep = [c for c in ("input_ids", "labels", "label") if c in docs.column_names]
        if id(docs) not in chosen:
            rows = np.zeros(len(docs), bool)
            rows[pack.unpacked(docs, opts.seq_len, opts.drop_long)] = True
            chosen[id(docs)] = rows
        rows = chosen[id(docs)]
        return docs.select(idx[rows[idx]]).select_columns(keep)
    docs = docs.select(idx) if len(idx) < len(docs) else docs
    packer = pack.Packer(opts.seq_len, pad_id(tokenizer), packing, opts.drop_long, split_long=fmt == "text",
                         compact=True)
    key = _fingerprint(docs._fingerprint, opts.seq_len, packing, opts.drop_long, packer.split_long)
    keep = [c for c in ("input_ids", "labels") if c in docs.column_names]
    return docs.select_columns(keep).with_format("arrow").map(
        packer, batched=True, batch_size=pack.BATCH, remove_columns=keep, new_fingerprint=key,
        features=pack.features(opts.seq_len, compact=True, labels="labels" in keep),
        cache_file_name=_cache_file(opts, f"rows-{key}"), desc=f"Packing {name} rows").with_format(None)


def _stats(tokenized: list, opts: DataOptions, packing: bool, fmt: str) -> dict:
    """Documents longer than seq_len and documents with no token to train on (train and eval: every tokenized
    document), counted in Arrow on the whole columns."""
    import pyarrow.compute as pc

    long = untrained = 0
    for docs in tokenized:
        if len(docs):
            long += pc.sum(pc.greater(docs.data.column("length"), opts.seq_len)).as_py() or 0
            untrained += pc.sum(pc.equal(docs.data.column("trained"), 0)).as_py() or 0
    policy = ("dropped (--drop-long)" if opts.drop_long else "cut into pieces of --seq-len" if packing and fmt == "text"
              else "truncated (--drop-long drops them)")
    return {"long": long, "long_policy": policy, "untrained": untrained}


def pad_id(tokenizer) -> int:
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token is not None:
            return token
    return 0


def tokenizer_fingerprint(tokenizer, chat: bool = False) -> str:
    """What makes a tokenizer's ids: its vocabulary and rules (its tokenizer.json as the backend writes it, less
    the truncation and padding, which dstk's calls do not use), its special tokens and, for chat formats, its
    chat template."""
    from toolkit.data.tokens import backend

    engine = backend(tokenizer)  # without truncation or padding
    body = engine.to_str() if engine is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([type(tokenizer).__name__, tokenizer.special_tokens_map,
                        tokenizer.chat_template if chat else None], default=str)
    return hashlib.sha256((body + extra).encode()).hexdigest()


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps([VERSION, *parts], default=str).encode()).hexdigest()[:32]


def _cache_file(opts: DataOptions, name: str) -> str:
    return str(cache_root(opts.cache_dir) / f"{name}.arrow")


def prepare_once_per_node(opts: DataOptions, tokenizer) -> Prepared:
    """prepare() on one rank first (it builds the caches, with its progress line), then on the others (cache
    hits, quiet; they wait for it in a group with no timeout): global rank 0 where the cache folder is one for every node (a shared file system: nodes writing
    the same cache files at once would race), else each node's local rank 0 (process_group.once_per_node).
    A refusal there is raised on every rank, same message."""
    import datasets

    from toolkit.distributed.process_group import once_per_node

    result, built = once_per_node(lambda: prepare(opts, tokenizer), "preparing --data",
                                  shared_dir=opts.cache_dir or datasets.config.HF_DATASETS_CACHE)
    if built:
        return result
    datasets.disable_progress_bars()
    try:
        return prepare(opts, tokenizer, quiet=True)
    finally:
        datasets.enable_progress_bars()
