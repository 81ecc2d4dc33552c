"""Unpacked rows are cached as they are (no padding, no doc_ids) and padded when a micro-batch is read:
batches.Rows gives exactly the padded rows the packer writes for the streaming path, for language-model
rows (labels, or text whose labels are its ids), truncated or dropped long documents, and classification;
and a cache of short rows at a long --seq-len holds their tokens, not the padding."""

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


def documents(kind: str, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * SEQ, 60)
    ids = [rng.integers(10, 200, n).tolist() for n in lengths]
    columns = {"input_ids": pa.array(ids, pa.list_(pa.int32()))}
    if kind == "labels":
        columns["labels"] = pa.array([[t if rng.random() < 0.6 else IGNORE_INDEX for t in row] for row in ids],
                                     pa.list_(pa.int32()))
    if kind == "classification":
        columns["label"] = pa.array(rng.integers(0, 3, len(ids)), pa.int64())
    return pa.table(columns)


def read(table: pa.Table, ragged: bool, classification: bool):
    import datasets

    return Rows(datasets.Dataset(table).cast(pack.features(SEQ, classification, ragged)), SEQ, PAD)


@pytest.mark.parametrize("kind", ["labels", "text", "classification"])
@pytest.mark.parametrize("drop_long", [False, True])
def test_ragged_rows_read_as_the_padded_rows(kind, drop_long):
    docs = documents(kind)
    classification = kind == "classification"
    fixed, ragged = (pack.Packer(SEQ, PAD, packing=False, drop_long=drop_long, split_long=False, ragged=r)(docs)
                     for r in (False, True))
    assert "doc_ids" not in ragged.column_names and ragged.num_rows == fixed.num_rows > 20
    stored = sum(len(r) for r in ragged.column("input_ids").to_pylist())
    padded, unpadded = read(fixed, False, classification), read(ragged, True, classification)
    assert stored == int(unpadded.batch(range(len(unpadded)))[0][1].sum()) < fixed.num_rows * SEQ  # no padding
    order = list(np.random.default_rng(1).permutation(len(padded)))[:13]
    (ids_a, docs_a), labels_a = padded.batch(order)
    (ids_b, docs_b), labels_b = unpadded.batch(order)
    assert ids_a.equal(ids_b) and docs_a.equal(docs_b) and labels_a.equal(labels_b)
    assert (docs_b == 0).any() and (ids_b[docs_b == 0] == PAD).all()
    (ids, docs), labels = unpadded.batch([])
    assert ids.shape == (0, SEQ) and labels.shape[0] == 0


def test_a_chat_cache_at_a_long_seq_len_holds_the_tokens_not_the_padding(tmp_path):
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
    rows_file = max((tmp_path / "cache" / "dstk").glob("rows-*.arrow"), key=lambda p: p.stat().st_size)
    assert rows_file.stat().st_size < 200 * 4096 * 4 / 20  # padded, input_ids alone would be 3.3 MB
