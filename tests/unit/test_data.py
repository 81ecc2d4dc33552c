"""toolkit.data: packing, document ids, labels, splits, caches and the per-rank order (no process group)."""

import json

import pytest
import torch

from toolkit.errors import ConfigError, UnusableInput
from toolkit import data
from toolkit.train.hf import byte_tokenizer

EOT = 256


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def prepare(tmp_path, tok, name, content, **kw):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    kw.setdefault("eval_fraction", 0.0)
    return data.prepare(data.DataOptions(str(path), cache_dir=str(tmp_path / "cache"), **kw), tok)


def rows(split: data.Rows):
    (ids, docs), labels = split.batch(range(len(split)))
    return ids.tolist(), docs.tolist(), labels.tolist()


def test_text_documents_are_packed_with_document_ids_and_no_cross_document_target(tmp_path, tok):
    got = prepare(tmp_path, tok, "a.txt", "abc\n\ndefg\n\n\n", seq_len=10)
    ids, docs, labels = rows(got.train)
    assert ids == [[97, 98, 99, EOT, 100, 101, 102, 103, EOT, EOT]]  # a b c EOT d e f g EOT pad
    assert docs == [[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]]
    assert labels == [[-100, 98, 99, EOT, -100, 101, 102, 103, EOT, -100]]  # 'd' is nobody's target
    assert got.info["format"] == "text" and got.info["packing"] and "inferred" in got.info["how"]


def test_next_fit_closes_a_row_a_document_does_not_fit_and_long_text_is_cut(tmp_path, tok):
    got = prepare(tmp_path, tok, "b.txt", "abc\n\ndefg\n\n" + "x" * 13, seq_len=8)
    ids, docs, _ = rows(got.train)
    assert docs == [[1, 1, 1, 1, 0, 0, 0, 0], [1] * 5 + [0] * 3, [1] * 8, [1] * 6 + [0] * 2]
    assert ids[2] == [120] * 8 and ids[3] == [120] * 5 + [EOT, EOT, EOT]
    assert got.info["long"] == 1 and "cut into pieces" in got.info["long_policy"]


def test_without_packing_each_document_is_a_padded_row_and_long_ones_are_counted(tmp_path, tok):
    got = prepare(tmp_path, tok, "c.txt", "abc\n\n" + "y" * 20, seq_len=6, packing=False)
    ids, docs, labels = rows(got.train)
    assert docs == [[1, 1, 1, 1, 0, 0], [1] * 6] and ids[1] == [121] * 6
    assert got.info["long"] == 1 and "truncated" in got.info["long_policy"]
    dropped = prepare(tmp_path, tok, "c2.txt", "abc\n\n" + "y" * 20, seq_len=6, packing=False, drop_long=True)
    assert len(dropped.train) == 1 and "dropped" in dropped.info["long_policy"]


def test_prompt_response_masks_the_prompt_and_the_padding(tmp_path, tok):
    got = prepare(tmp_path, tok, "pr.jsonl", json.dumps({"prompt": "Q:", "response": "ok"}) + "\n", seq_len=8)
    ids, docs, labels = rows(got.train)
    assert ids[0][:5] == [81, 58, 111, 107, EOT]  # Q : o k EOT
    assert labels[0] == [-100, -100, 111, 107, EOT, -100, -100, -100]
    assert docs[0] == [1] * 5 + [0] * 3 and got.info["format"] == "prompt-completion" and not got.info["packing"]


def test_classification_rows_keep_their_labels(tmp_path, tok):
    text = "\n".join(json.dumps({"text": t, "label": y}) for t, y in [("good", 1), ("bad", 0)])
    got = prepare(tmp_path, tok, "cls.jsonl", text, seq_len=6, task="classification")
    (ids, docs), labels = got.train.batch([0, 1])
    assert labels.tolist() == [1, 0] and ids.shape == (2, 6) and docs[1].tolist() == [1, 1, 1, 0, 0, 0]
    assert got.info["num_labels"] == 2


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ("", "is empty"), ("  \n", "is empty")])
def test_missing_or_empty_file_is_a_clear_error(tmp_path, tok, content, message):
    path = tmp_path / "d.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UnusableInput, match=message):
        data.prepare(data.DataOptions(str(path), 8, cache_dir=str(tmp_path / "cache")), tok)


def test_broken_jsonl_names_the_line(tmp_path, tok):
    with pytest.raises(UnusableInput, match="d.jsonl:2"):
        prepare(tmp_path, tok, "d.jsonl", '{"text": "a"}\n{"text": \n', seq_len=8)


def test_sequence_longer_than_the_positions_is_refused(tmp_path, tok):
    with pytest.raises(ConfigError, match="--seq-len 300 is longer than the model's 256 positions"):
        prepare(tmp_path, tok, "x.txt", "x" * 1000, seq_len=300, max_positions=256)


def test_too_little_data_for_one_batch(tmp_path, tok):
    got = prepare(tmp_path, tok, "y.txt", "x" * 39, seq_len=8)  # 5 rows
    with pytest.raises(ConfigError, match=r"mbs\(2\) \* gas\(2\) \* dp\(2\) = 8"):
        data.ShardedBatches(got.train, mbs=2, gas=2, dp=2, dp_rank=0, seed=0)


def test_split_is_by_document_before_packing_seeded_and_disjoint(tmp_path, tok):
    text = "\n\n".join(f"doc{i:02d}" for i in range(40))
    a = prepare(tmp_path, tok, "s.txt", text, seq_len=16, eval_fraction=0.1, seed=5)
    b = prepare(tmp_path, tok, "s.txt", text, seq_len=16, eval_fraction=0.1, seed=5)
    assert a.info["eval_documents"] == 4 and a.info["train_documents"] == 36 and rows(a.train) == rows(b.train)

    def names(split):
        return {bytes(t for t in row if t < 256).decode() for row in rows(split)[0]}

    train, held = set("".join(names(a.train)).split("doc")) - {""}, set("".join(names(a.eval)).split("doc")) - {""}
    assert len(held) == 4 and len(train) == 36 and not train & held


def test_a_second_prepare_reads_the_cache(tmp_path, tok):
    first = prepare(tmp_path, tok, "c.txt", "hello there\n\nbye now", seq_len=8)
    files = sorted(p.name for p in (tmp_path / "cache" / "dstk").iterdir())
    opts = data.DataOptions(str(tmp_path / "c.txt"), 8, eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    again = data.prepare(opts, tok)
    assert sorted(p.name for p in (tmp_path / "cache" / "dstk").iterdir()) == files
    assert again.train.ds.cache_files == first.train.ds.cache_files and rows(again.train) == rows(first.train)
    opts.seq_len = 12  # another fingerprint: the tokens are reused, the rows are new
    assert len(data.prepare(opts, tok).train.ds.cache_files) and len(list((tmp_path / "cache" / "dstk").iterdir())) \
        == len(files) + 1
    (tmp_path / "c.txt").write_text("hello there\n\nbye later")  # an edited file: read again
    assert rows(data.prepare(opts, tok).train) != rows(first.train)


def test_packed_row_loss_equals_each_document_alone(tmp_path, tok):
    """The contract with models/: attention_inputs(doc_ids) at pp = 1 keeps each document to itself."""
    from models.spec import attention_inputs
    from models.weights import loading
    from toolkit.train import hf

    got = prepare(tmp_path, tok, "p.txt", "hello world\n\nthe cat sat\n\nok", seq_len=32)
    (ids, docs), labels = got.train.batch([0])
    assert docs.max() == 3
    config = hf.load_config("tiny-gpt2", tok, "causal-lm")
    model = loading.build_model("tiny-gpt2", config, "causal-lm", 0).eval()
    mask, positions = attention_inputs(docs)
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0]
        for k in (1, 2, 3):
            where = (docs[0] == k).nonzero().flatten()
            alone = model(input_ids=ids[:, where]).logits[0]
            assert (packed[where] - alone).abs().max() < 1e-4, k


def _numbered(n, t=4) -> data.TokenData:
    ids = torch.arange(n).repeat_interleave(t).view(n, t)  # row i is all i: easy to trace
    return data.TokenData(ids, torch.ones_like(ids), ids.clone())


def _rows_of(sampler, steps, start=0):
    it = sampler.micro_batches(start)
    return [next(it)[0][0][:, 0].tolist() for _ in range(steps * sampler.gas)]


def test_replicas_partition_each_step_and_match_one_replica():
    rows_ = _numbered(50)
    one = _rows_of(data.ShardedBatches(rows_, mbs=2, gas=2, dp=1, dp_rank=0, seed=7), steps=3)
    two = [_rows_of(data.ShardedBatches(rows_, mbs=2, gas=1, dp=2, dp_rank=r, seed=7), steps=3) for r in (0, 1)]
    for step in range(3):
        a = sorted(sum(one[2 * step: 2 * step + 2], []))
        b = sorted(two[0][step] + two[1][step])
        assert a == b  # the same 4 rows form step `step` with dp=1 and dp=2
    seen = [x for r in (0, 1) for mb in two[r] for x in mb]
    assert len(seen) == len(set(seen))  # no row is seen by both replicas within the epoch


def test_order_is_torch_distributed_sampler_over_micro_batches():
    """torch's own samplers: a seeded permutation (DistributedSampler's recipe) cut by a BatchSampler,
    the micro-batches dealt to the replicas by a DistributedSampler."""
    from torch.utils.data import BatchSampler, DistributedSampler

    perm = DistributedSampler(range(20), num_replicas=1, rank=0, shuffle=True, seed=3)
    batches = list(BatchSampler(list(perm), batch_size=2, drop_last=True))
    mine = DistributedSampler(batches, num_replicas=2, rank=1, shuffle=False, drop_last=True)
    ours = _rows_of(data.ShardedBatches(_numbered(20), mbs=2, gas=1, dp=2, dp_rank=1, seed=3), steps=5)
    assert ours == [batches[j] for j in mine]


def test_every_layout_runs_the_same_micro_batches_in_a_step():
    rows_ = _numbered(48)
    one = _rows_of(data.ShardedBatches(rows_, mbs=2, gas=4, dp=1, dp_rank=0, seed=9), steps=3)
    for dp in (2, 4):
        gas = 4 // dp
        ranks = [_rows_of(data.ShardedBatches(rows_, mbs=2, gas=gas, dp=dp, dp_rank=r, seed=9), steps=3)
                 for r in range(dp)]
        for step in range(3):
            theirs = [mb for r in ranks for mb in r[step * gas: (step + 1) * gas]]
            assert sorted(theirs) == sorted(one[step * 4: (step + 1) * 4])  # the same micro-batches, not just rows


def test_epochs_reshuffle_and_resume_continues_the_same_order():
    rows_ = _numbered(16)
    s = data.ShardedBatches(rows_, mbs=2, gas=2, dp=1, dp_rank=0, seed=1)  # 4 steps per epoch
    whole = _rows_of(s, steps=8)
    assert sorted(sum(whole[:8], [])) == sorted(sum(whole[8:], [])) and whole[:8] != whole[8:]
    assert _rows_of(s, steps=3, start=5) == whole[10:16]
    assert _rows_of(data.ShardedBatches(rows_, 2, 2, 1, 0, seed=1), steps=8) == whole  # deterministic


def test_eval_batches_cover_the_split_once_and_fill_up_with_rows_without_loss():
    rows_ = _numbered(7)
    seen, weights = [], []
    for rank in (0, 1):
        batches = list(data.eval_micro_batches(rows_, mbs=3, dp=2, dp_rank=rank))
        assert len(batches) == data.eval_batch_count(7, 3, 2) == 2
        for (ids, docs), labels in batches:
            real = labels[:, 1] != -100
            seen += ids[real, 0].tolist()
            assert (docs[~real] == 1).all()  # filler rows: one document, no fully masked row
            weights.append(data.loss_weight(labels))
    assert sorted(seen) == list(range(7)) and sum(weights) == 7 * 3


def test_tokenizing_processes_do_not_change_the_rows(tmp_path, tok):
    text = "\n\n".join(f"document number {i} " + "z" * (i % 7) for i in range(60))
    one = prepare(tmp_path, tok, "w.txt", text, seq_len=40, eval_fraction=0.1)
    opts = data.DataOptions(str(tmp_path / "w.txt"), 40, eval_fraction=0.1, workers=2,
                            cache_dir=str(tmp_path / "cache2"))
    two = data.prepare(opts, tok)
    assert rows(two.train) == rows(one.train) and rows(two.eval) == rows(one.eval)
