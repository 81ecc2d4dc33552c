"""Unpacked rows are not written again: the documents that make a row (pack.unpacked) are read from the
tokens cache and padded when a micro-batch is read. batches.Rows gives exactly the padded rows the packer
writes for the streaming path, for language-model rows (labels, or text whose labels are its ids),
truncated or dropped long documents (kept or dropped by the tokens they train on), and classification;
and a chat preparation at a long --seq-len writes the tokens once, no padding and no copy."""

import json

import numpy as np
import pyarrow as pa
import pytest

from toolkit import data
from toolkit.data import pack
from toolkit.data.batches import Rows
from toolkit.data.formats import IGNORE_INDEX
from toolkit.train.hf import byte_tokenizer

SEQ, PAD = 16, 7


def documents(kind: str, seed: int = 0):
    """60 tokenized documents as the tokens cache holds them (length, trained), 1 to 2 x SEQ tokens long; some
    train on nothing, some only after SEQ tokens."""
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * SEQ, 60)
    ids = [rng.integers(10, 200, n).tolist() for n in lengths]
    columns = {"input_ids": pa.array(ids, pa.list_(pa.int32()))}
    if kind == "labels":
        labels = [[t if rng.random() < 0.6 else IGNORE_INDEX for t in row] for row in ids]
        labels[:6] = [[IGNORE_INDEX] * len(row) for row in ids[:6]]  # nothing to train on
        labels[6:12] = [[IGNORE_INDEX] * min(SEQ, len(row)) + row[SEQ:] for row in ids[6:12]]  # after SEQ tokens
        columns["labels"] = pa.array(labels, pa.list_(pa.int32()))
        trained = [sum(t != IGNORE_INDEX for t in row[1:]) for row in labels]
    else:
        trained = [max(len(row) - 1, 0) if kind == "text" else 1 for row in ids]
    if kind == "classification":
        columns["label"] = pa.array(rng.integers(0, 3, len(ids)), pa.int64())
    columns.update(length=pa.array(lengths.tolist(), pa.int64()), trained=pa.array(trained, pa.int64()))
    return datasets.Dataset(pa.table(columns)).select(range(3, 60))  # an indices mapping, as a split's


@pytest.mark.parametrize("kind", ["labels", "text", "classification"])
@pytest.mark.parametrize("drop_long", [False, True])
def test_unpacked_documents_read_as_the_padded_rows(kind, drop_long):
    import datasets

    docs = documents(kind)
    classification = kind == "classification"
    keep = [c for c in ("input_ids", "labels", "label") if c in docs.column_names]
    fixed = pack.Packer(SEQ, PAD, packing=False, drop_long=drop_long, split_long=False)(
        docs.select_columns(keep).with_format("arrow")[:])
    chosen = docs.select(pack.unpacked(docs, SEQ, drop_long)).select_columns(keep)
    padded = Rows(datasets.Dataset(fixed).cast(pack.features(SEQ, classification)), SEQ, PAD)
    unpadded = Rows(chosen, SEQ, PAD)
    assert len(unpadded) == len(padded) > 10
    order = list(np.random.default_rng(1).permutation(len(padded)))[:13]
    (ids_a, docs_a), labels_a = padded.batch(order)
    (ids_b, docs_b), labels_b = unpadded.batch(order)
    assert ids_a.equal(ids_b) and docs_a.equal(docs_b) and labels_a.equal(labels_b)
    assert (docs_b == 0).any() and (ids_b[docs_b == 0] == PAD).all()
    assert drop_long or (unpadded.batch(range(len(unpadded)))[0][1].sum(1) == SEQ).any()  # truncated rows read
    (ids, docs), labels = unpadded.batch([])
    assert ids.shape == (0, SEQ) and labels.shape[0] == 0


def test_a_chat_cache_at_a_long_seq_len_writes_the_tokens_once(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        for n in range(200):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {n}?"},
                                             {"role": "assistant", "content": "answer " * (n % 7 + 1)}]}) + "\n")
    opts = data.DataOptions(str(path), 4096, cache_dir=str(tmp_path / "cache"), eval_fraction=0.0)
    prepared = data.prepare(opts, tok)
    (ids, docs), labels = prepared.train.batch(range(len(prepared.train)))
    assert ids.shape == (200, 4096) and int(docs.sum()) < 200 * 100
    written = {p.name.split("-")[0]: p.stat().st_size for p in (tmp_path / "cache" / "dstk").glob("*.arrow")}
    assert "rows" not in written and written["tokens"] < 200 * 4096 * 4 / 20  # padded input_ids alone: 3.3 MB


@pytest.mark.parametrize("kind", ["labels", "text"])
@pytest.mark.parametrize("split_long", [False, True])
def test_compact_packed_rows_read_as_the_full_ones(kind, split_long):
    """The cache keeps packed rows compact (each row's document lengths, no labels for text): Rows rebuilds
    doc_ids and the text labels (-100 on each document's first token and the padding) exactly."""
    import datasets

    docs = documents(kind)
    keep = [c for c in ("input_ids", "labels") if c in docs.column_names]
    table = docs.select_columns(keep).with_format("arrow")[:]
    full, compact = (pack.Packer(SEQ, PAD, packing=True, drop_long=False, split_long=split_long, compact=c)(table)
                     for c in (False, True))
    assert ("labels" in compact.column_names) == (kind == "labels") and "doc_ids" not in compact.column_names
    a = Rows(datasets.Dataset(full).cast(pack.features(SEQ)), SEQ, PAD)
    b = Rows(datasets.Dataset(compact).cast(pack.features(SEQ, compact=True, labels=kind == "labels")), SEQ, PAD)
    assert len(a) == len(b) > 10
    order = list(np.random.default_rng(2).permutation(len(a)))
    (ids_a, docs_a), labels_a = a.batch(order)
    (ids_b, docs_b), labels_b = b.batch(order)
    assert ids_a.equal(ids_b) and docs_a.equal(docs_b) and labels_a.equal(labels_b)
    assert int(docs_a.max()) > 1 and (docs_a == 0).any()  # rows of several documents, and padding
    (ids, docs), labels = b.batch([])
    assert ids.shape == (0, SEQ) and labels.shape == (0, SEQ)


@pytest.mark.parametrize("eval_fraction", [0.0, 0.2])
def test_prepared_unpacked_rows_are_each_splits_documents_that_make_a_row(tmp_path, eval_fraction):
    """prepare chooses the unpacked rows over all the documents at once, then takes each split's: the same rows,
    in the same order, as the packer's padded rows of that split's documents."""
    import datasets

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    path, rng, seq = tmp_path / "chat.jsonl", np.random.default_rng(3), 40
    with open(path, "w") as f:
        for n in range(120):  # some longer than seq, some with nothing to train on within it
            reply = "" if n % 9 == 0 else "a" * int(rng.integers(1, 2 * seq))
            f.write(json.dumps({"messages": [{"role": "user", "content": "q" * int(rng.integers(1, seq))},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    opts = data.DataOptions(str(path), seq, cache_dir=str(tmp_path / "cache"), eval_fraction=eval_fraction)
    prepared = data.prepare(opts, tok)
    tokens = data.load(str(path), "utf-8", opts.cache_dir)  # the documents, tokenized again without the cache
    from toolkit.data.formats import Encoder

    docs = tokens.with_format("arrow").map(Encoder("chat", tok, str(path)), batched=True, with_indices=True,
                                           remove_columns=tokens.column_names).with_format(None)
    halves = data.split_documents(docs, eval_fraction, opts.seed)
    for rows, half in zip((prepared.train, prepared.eval), halves):
        if len(half) == 0:
            assert len(rows) == 0
            continue
        fixed = pack.Packer(seq, tok.pad_token_id, packing=False, drop_long=False, split_long=False)(
            half.select_columns(["input_ids", "labels"]).with_format("arrow")[:])
        expected = Rows(datasets.Dataset(fixed).cast(pack.features(seq)), seq, tok.pad_token_id)
        assert len(rows) == len(expected) and 0 < len(rows) < len(half)
        everything = list(range(len(rows)))
        assert all(a.equal(b) for a, b in zip(rows.batch(everything)[0] + (rows.batch(everything)[1],),
                                              expected.batch(everything)[0] + (expected.batch(everything)[1],)))
    assert len(prepared.eval) > 0 or eval_fraction == 0


def test_prepare_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    """prepare freezes the objects alive before it (no full collection walks them while it tokenizes) and
    unfreezes them after, on success and on a refusal; a caller's own freeze is left alone."""
    import gc

    from toolkit.errors import ConfigError

    tok = byte_tokenizer()
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {n} " * 5}) + "\n" for n in range(50)))
    seen, was_frozen = [], gc.get_freeze_count()  # tests/conftest.py freezes what the collection imported
    gc.unfreeze()
    gc.callbacks.append(seen_freeze := lambda phase, info: seen.append(gc.get_freeze_count()))
    try:
        gc.collect()
        assert gc.get_freeze_count() == 0
        data.prepare(data.DataOptions(str(path), SEQ, cache_dir=str(tmp_path / "c")), tok)
        assert gc.get_freeze_count() == 0
        with pytest.raises(ConfigError):
            data.prepare(data.DataOptions(str(path), SEQ, cache_dir=str(tmp_path / "c"), eval_fraction=2.0), tok)
        assert gc.get_freeze_count() == 0
        seen.clear()
        data.prepare(data.DataOptions(str(path), SEQ + 1, cache_dir=str(tmp_path / "c")), tok)
        gc.collect()
        assert gc.get_freeze_count() == 0 and max(seen, default=0) > 0  # frozen while it ran, then not
        gc.freeze()
        frozen = gc.get_freeze_count()
        data.prepare(data.DataOptions(str(path), SEQ, cache_dir=str(tmp_path / "c")), tok)
        assert gc.get_freeze_count() > frozen // 2  # still frozen (less what died meanwhile)
    finally:
        gc.callbacks.remove(seen_freeze)
        gc.unfreeze()
        if was_frozen:
            gc.collect()
            gc.freeze()
