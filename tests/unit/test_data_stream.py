"""--streaming rows (toolkit.data.stream): sharded by dp rank, the prepared path's tokens and packing, and a position
from which a new stream goes on with exactly the micro-batches the first one would have given."""

import json
from itertools import islice

import pytest
import torch

from toolkit import data
from toolkit.data.stream import StreamBatches
from toolkit.errors import UnusableInput
from toolkit.train.hf import byte_tokenizer

DOCS = 2300  # > 2 packing batches (pack.BATCH documents) per rank at dp 1, > 1 at dp 2: both boundaries crossed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " + "ab" * (i % 7)}) + "\n" for i in range(DOCS)))
    return path


def opts(path, seq_len=16, **kw):
    return data.DataOptions(path=str(path), seq_len=seq_len, eval_fraction=0.0, cache_dir=str(path.parent / "cache"), **kw)


def take(sampler, n):
    return list(islice(sampler.micro_batches(), n))


def same(a, b) -> bool:
    return all(torch.equal(x[0][0], y[0][0]) and torch.equal(x[0][1], y[0][1]) and torch.equal(x[1], y[1])
               for x, y in zip(a, b, strict=True))


def test_a_stream_resumed_from_its_position_gives_the_micro_batches_that_follow(corpus):
    """Cut after k micro-batches, inside a packing batch, at the batch boundary region and after the share ran
    out (the next pass): a new stream from the saved position yields the rest, tensor for tensor."""
    tok = byte_tokenizer()
    whole = StreamBatches(opts(corpus), tok, 3, 2, 2, 1)
    it = whole.micro_batches()
    first = list(islice(it, 5))
    seen, positions = [], []
    for _ in range(700):  # past the end of rank 1's share of DOCS // 2 documents: a second pass starts
        positions.append(dict(whole.position))
        seen.append(next(it))
    assert positions[-1]["pass"] == 1 and any(p["docs"] > 0 for p in positions)
    for k in (0, 1, 333, len(seen) - 10) + tuple(i for i in range(1, len(positions))
                                                 if positions[i]["docs"] != positions[i - 1]["docs"]):
        again = StreamBatches(opts(corpus), tok, 3, 2, 2, 1)
        again.resume_from(positions[k])
        assert same(take(again, 6), seen[k: k + 6]), (k, positions[k])
    assert not same(first[:1], seen[:1])


def test_dp_ranks_read_distinct_rows_and_every_rank_of_a_replica_the_same(corpus):
    tok = byte_tokenizer()
    r0, r0_again, r1 = (StreamBatches(opts(corpus), tok, 2, 1, 2, r) for r in (0, 0, 1))
    a, b, c = take(r0, 20), take(r0_again, 20), take(r1, 20)
    assert same(a, b)
    rows0 = {tuple(row.tolist()) for (ids, _), _ in a for row in ids}
    rows1 = {tuple(row.tolist()) for (ids, _), _ in c for row in ids}
    assert not rows0 & rows1


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.parquet", "docs.txt", "pairs.jsonl", "chat.jsonl"])
def test_one_rank_streams_the_prepared_paths_rows_in_file_order(corpus, name):
    """dp 1: the same encoder and packer over the same documents in the same batches: the rows the prepared
    (cached) path builds, in its file order (text in .jsonl, .parquet and .txt; prompt-completion, padded)."""
    docs = [json.loads(line) for line in corpus.read_text().splitlines()]
    path = corpus.parent / name
    if name == "docs.parquet":
        _parquet(path, docs)
    elif name == "docs.txt":
        path.write_text("\n\n".join(d["text"] for d in docs) + "\n")
    elif name == "pairs.jsonl":
        path.write_text("".join(json.dumps({"prompt": d["text"], "completion": " ok"}) + "\n" for d in docs[:1500]))
    elif name == "chat.jsonl":
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": d["text"][:6]},
                                                         {"role": "assistant", "content": "ok"}]}) + "\n"
                                for d in docs[:1200]))
    tok = byte_tokenizer()
    tok.chat_template = CHATML if name == "chat.jsonl" else tok.chat_template
    seq_len = 64 if name == "chat.jsonl" else 16  # a chat row's template alone is ~40 bytes
    prepared = data.prepare(opts(path, seq_len), tok, quiet=True).train
    n = len(prepared)
    streamed = take(StreamBatches(opts(path, seq_len), tok, 1, 1, 1, 0), n)
    assert n > 800 and same(streamed, [prepared.batch([i]) for i in range(n)])  # pairs: 872 with a completion token


def test_a_position_of_another_dp_layout_is_refused(corpus):
    stream = StreamBatches(opts(corpus), byte_tokenizer(), 2, 1, 2, 0)
    with pytest.raises(UnusableInput,
                       match="resume a streaming run with the data-parallel degree it was saved with"):
        stream.resume_from({"pass": 0, "docs": 0, "rows": 4, "dp": 4, "dp_rank": 0})


def test_micro_batches_take_the_rows_in_order_across_packing_batches(corpus):
    """mbs 3 against mbs 1, 3000 rows: the packing batches hold 1141, 1285 and 385 rows, so micro-batches join the
    end of one and the start of the next (and the next pass's first): no row lost, repeated or out of order."""
    tok = byte_tokenizer()
    ones = take(StreamBatches(opts(corpus), tok, 1, 1, 1, 0), 3000)
    threes = take(StreamBatches(opts(corpus), tok, 3, 1, 1, 0), 1000)
    grouped = []
    for k in range(0, 3000, 3):
        rows = ones[k: k + 3]
        grouped.append(((torch.cat([r[0][0] for r in rows]), torch.cat([r[0][1] for r in rows])),
                        torch.cat([r[1] for r in rows])))
    assert same(threes, grouped)


def test_a_broken_json_line_is_named_by_line_not_by_pyarrows_trace(tmp_path):
    """Row 50 not JSON once gave 165 lines of pyarrow traceback; the prepared path's message instead."""
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"doc {i} abab"}) for i in range(3000)]
    lines[2049] = '{"text": "broken'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UnusableInput, match=rf"{path}:2050: not valid JSON"):
        take(StreamBatches(opts(path), byte_tokenizer(), 2, 1, 1, 0), 2000)


@pytest.mark.parametrize("blank", ["all", "some"])
def test_documents_without_a_token_are_skipped_and_a_file_of_none_is_refused(tmp_path, blank):
    """Every text empty once failed with `cannot reshape tensor of 0 elements` (and would then have read the file
    for ever); packing batches without a row are skipped."""
    path = tmp_path / "docs.jsonl"
    texts = ["" if blank == "all" or i < 1500 else f"doc {i} abab" for i in range(2000)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    sampler = StreamBatches(opts(path), byte_tokenizer(), 2, 1, 1, 0)
    if blank == "all":
        with pytest.raises(UnusableInput, match="none of this rank's 2000 documents gives a token to train on"):
            take(sampler, 1)
    else:
        ids = take(sampler, 3)[0][0][0]
        assert ids.shape == (2, 16) and (ids > 0).any()
