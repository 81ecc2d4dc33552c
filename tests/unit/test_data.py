"""toolkit.train.data: formats, packing, masks, splits and the per-rank order (no process group)."""

import json

import pytest
import torch

from toolkit.train import data
from toolkit.errors import ConfigError, UnusableInput
from toolkit.train.hf import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_plain_text_is_packed_into_full_rows_of_bytes_and_eos(tmp_path, tok):
    path = tmp_path / "a.txt"
    path.write_text("abc\n\ndefg\n\n\n")
    rows = data.tokenize(data.read_records(path), tok, seq_len=3)
    # stream: a b c EOT d e f g EOT (9 ids) -> 3 rows of 3
    assert rows.input_ids.tolist() == [[97, 98, 99], [256, 100, 101], [102, 103, 256]]
    assert rows.attention_mask.all() and torch.equal(rows.labels, rows.input_ids)


def test_prompt_response_masks_the_prompt_and_the_padding(tmp_path, tok):
    path = tmp_path / "pr.jsonl"
    path.write_text(json.dumps({"prompt": "Q:", "response": "ok"}) + "\n")
    rows = data.tokenize(data.read_records(path), tok, seq_len=8)
    assert rows.input_ids[0, :5].tolist() == [81, 58, 111, 107, 256]  # Q : o k EOT
    assert rows.labels[0].tolist() == [-100, -100, 111, 107, 256, -100, -100, -100]
    assert rows.attention_mask[0].tolist() == [1] * 5 + [0] * 3


def test_classification_rows_keep_their_labels(tmp_path, tok):
    path = tmp_path / "cls.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "label": y}) for t, y in [("good", 1), ("bad", 0)]))
    rows = data.tokenize(data.read_records(path), tok, seq_len=6, task="classification")
    assert rows.labels.tolist() == [1, 0] and rows.input_ids.shape == (2, 6)


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ("", "is empty"), ("  \n", "is empty")])
def test_missing_or_empty_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "d.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UnusableInput, match=message):
        data.read_records(path)


def test_broken_jsonl_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(UnusableInput, match="d.jsonl:2"):
        data.read_records(path)


def test_sequence_longer_than_the_positions_is_refused(tok):
    with pytest.raises(ConfigError, match="--seq-len 300 is longer than the model's 256 positions"):
        data.tokenize(["x" * 1000], tok, seq_len=300, max_positions=256)


def test_too_little_data_for_one_row_or_one_batch(tok):
    with pytest.raises(ConfigError, match="fewer than one row"):
        data.tokenize(["hi"], tok, seq_len=64)
    rows = data.tokenize(["x" * 40], tok, seq_len=8)  # 5 rows
    with pytest.raises(ConfigError, match=r"mbs\(2\) \* gas\(2\) \* dp\(2\) = 8"):
        data.ShardedBatches(rows, mbs=2, gas=2, dp=2, dp_rank=0, seed=0)


def _numbered(n, t=4) -> data.TokenData:
    ids = torch.arange(n).repeat_interleave(t).view(n, t)  # row i is all i: easy to trace
    return data.TokenData(ids, torch.ones_like(ids), ids.clone())


def _rows_of(sampler, steps, start=0):
    it = sampler.micro_batches(start)
    return [next(it)[0][0][:, 0].tolist() for _ in range(steps * sampler.gas)]


def test_replicas_partition_each_step_and_match_one_replica():
    rows = _numbered(50)
    one = _rows_of(data.ShardedBatches(rows, mbs=2, gas=2, dp=1, dp_rank=0, seed=7), steps=3)
    two = [_rows_of(data.ShardedBatches(rows, mbs=2, gas=1, dp=2, dp_rank=r, seed=7), steps=3) for r in (0, 1)]
    for step in range(3):
        a = sorted(sum(one[2 * step: 2 * step + 2], []))
        b = sorted(two[0][step] + two[1][step])
        assert a == b  # the same 4 rows form step `step` with dp=1 and dp=2
    seen = [x for r in (0, 1) for mb in two[r] for x in mb]
    assert len(seen) == len(set(seen))  # no row is seen by both replicas within the epoch


def test_order_is_torch_distributed_sampler_order():
    from torch.utils.data import DistributedSampler

    rows = _numbered(20)
    ours = _rows_of(data.ShardedBatches(rows, mbs=2, gas=1, dp=2, dp_rank=1, seed=3), steps=5)
    ref = list(DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True))
    assert sum(ours, []) == ref[:10]


def test_epochs_reshuffle_and_resume_continues_the_same_order():
    rows = _numbered(16)
    s = data.ShardedBatches(rows, mbs=2, gas=2, dp=1, dp_rank=0, seed=1)  # 4 steps per epoch
    whole = _rows_of(s, steps=8)
    assert sorted(sum(whole[:8], [])) == sorted(sum(whole[8:], [])) and whole[:8] != whole[8:]
    assert _rows_of(s, steps=3, start=5) == whole[10:16]
    assert _rows_of(data.ShardedBatches(rows, 2, 2, 1, 0, seed=1), steps=8) == whole  # deterministic


def test_split_is_seeded_and_disjoint():
    rows = _numbered(40)
    train, held = data.split(rows, 0.1, seed=5)
    again, _ = data.split(rows, 0.1, seed=5)
    assert len(held) == 4 and len(train) == 36 and torch.equal(train.input_ids, again.input_ids)
    assert not set(train.input_ids[:, 0].tolist()) & set(held.input_ids[:, 0].tolist())
