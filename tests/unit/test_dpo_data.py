"""--objective dpo's data and loss (issue 47), in process: TRL's preference rows (strings, or message lists rendered
with the chat template) become two adjacent rows per pair, labels -100 on the prompt and padding; no shuffle, dp shard
or micro-batch splits a pair; the loss is ln 2 while the policy is the reference and the mean over the step's pairs
under accumulation; bad rows and an odd mbs are refused at `dstk train --check`, one line, no traceback."""

import json
import math

import pytest
import torch

from models.objectives import DpoLoss, pair_losses, sequence_logps
from tests.unit.test_train_refusals import REPO, refused, train_cli, train_config
from tests.configs import ds_config
from toolkit import data
from toolkit.train import hf

PAIRS = REPO / "toolkit" / "corpus" / "preferences.jsonl"
TEMPLATE = (REPO / "toolkit" / "corpus" / "chatml.jinja").read_text()


def prepare(tmp_path, rows, seq_len=64, eval_fraction=0.0, template=False):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = hf.byte_tokenizer()
    if template:
        tok.chat_template = TEMPLATE
    opts = data.DataOptions(path=str(path), seq_len=seq_len, eval_fraction=eval_fraction, cache_dir=str(tmp_path / "c"))
    return data.prepare(opts, tok, quiet=True), tok


def test_string_pairs_become_adjacent_rows_with_the_loss_on_the_completion_and_eos(tmp_path):
    prepared, tok = prepare(tmp_path, [{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5!"}])
    assert prepared.info["format"] == "preference" and len(prepared.train) == 1
    (ids, docs), (labels, ref) = prepared.train.batch([0])
    assert ids.shape == labels.shape == (2, 64) and ref.tolist() == [0.0, 0.0]
    prompt = tok("Q: 2+2?")["input_ids"]
    for row, completion in ((0, " 4"), (1, " 5!")):
        want = tok(completion)["input_ids"] + [tok.eos_token_id]  # TRL appends eos to string completions
        n = len(prompt) + len(want)
        assert ids[row, :n].tolist() == prompt + want and docs[row].sum() == n
        assert labels[row, :len(prompt)].eq(-100).all() and labels[row, len(prompt):n].tolist() == want
        assert labels[row, n:].eq(-100).all()  # padding


def test_conversational_pairs_are_rendered_with_the_chat_template(tmp_path):
    user = [{"role": "user", "content": "Hi"}]
    row = {"prompt": user, "chosen": [{"role": "assistant", "content": "Hello."}],
           "rejected": [{"role": "assistant", "content": "Go."}]}
    prepared, tok = prepare(tmp_path, [row], seq_len=128, template=True)
    (ids, _), (labels, _) = prepared.train.batch([0])
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    full = tok.apply_chat_template(user + row["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert ids[0, :len(full)].tolist() == full and labels[0, :len(prompt)].eq(-100).all()
    assert labels[0, len(prompt):len(full)].tolist() == full[len(prompt):]
    assert "Go." in tok.decode(ids[1][labels[1] != -100])


def test_no_shuffle_shard_or_micro_batch_splits_a_pair():
    prepared = data.prepare(data.DataOptions(path=str(PAIRS), seq_len=128, eval_fraction=0.1, cache_dir=None),
                            hf.byte_tokenizer(), quiet=True)
    seen = []
    for dp_rank in range(2):
        sampler = data.ShardedBatches(prepared.train, 4, 2, 2, dp_rank, 7)  # mbs 4 rows = 2 pairs
        assert sampler.mbs == 2 and sampler.gbs == 8
        stream = sampler.micro_batches()
        for _ in range(6):
            (ids, _), (labels, _) = next(stream)
            assert ids.shape[0] == 4
            for k in (0, 2):  # chosen then rejected of the same prompt: the rows agree up to the first label
                start = int((labels[k] != -100).nonzero()[0])
                assert torch.equal(ids[k, :start], ids[k + 1, :start]) and labels[k + 1, :start].eq(-100).all()
            seen.append(ids)
    assert not torch.equal(seen[0], seen[6])  # the two replicas read other pairs


def test_eval_filler_pairs_carry_no_loss(tmp_path):
    rows = [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"} for i in range(3)]
    prepared, _ = prepare(tmp_path, rows)
    batches = list(data.eval_micro_batches(prepared.train, 2, 1, 0))  # 2 pairs a micro-batch: 1 real + 1 filler
    assert [data.loss_weight(b[1]) for b in batches] == [2, 1]
    loss = DpoLoss(0.1)
    logits = torch.randn(4, 64, 300)
    (_, _), (labels, ref) = batches[1]
    alone = loss(logits[:2], (labels[:2], ref[:2]))  # the filler pair changes nothing
    assert torch.allclose(loss(logits, (labels, ref)), alone)


def test_the_loss_is_ln2_while_the_policy_is_the_reference_and_accumulates_as_one_batch():
    torch.manual_seed(0)
    logits, labels = torch.randn(8, 12, 50), torch.randint(0, 50, (8, 12))
    labels[:, :4] = -100
    logps = sequence_logps(logits, labels)
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    assert torch.allclose(logps, (want * (labels[:, 1:] != -100)).sum(1))
    loss = DpoLoss(0.1)
    assert abs(float(loss(logits, (labels, logps))) - math.log(2)) < 1e-7
    ref = logps + torch.randn(8)
    whole = loss(logits, (labels, ref))
    halves = (loss(logits[:4], (labels[:4], ref[:4])) + loss(logits[4:], (labels[4:], ref[4:]))) / 2
    assert torch.allclose(whole, halves)  # gas 2 (or dp 2) x 2 pairs = one batch of 4 pairs
    per, chosen, rejected = pair_losses(logps, ref, 0.1)
    margin = 0.1 * ((logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2]))
    assert torch.allclose(per, -torch.nn.functional.logsigmoid(margin)) and torch.allclose(chosen - rejected, margin)


def dpo_check(tmp_path, rows=None, *args, mbs=2):
    path = PAIRS
    if rows is not None:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train_cli(tmp_path, "--objective", "dpo", "--check", "--seq-len", "128", *args, data=path,
                     config=train_config(tmp_path, ds_config(mbs, 1)))


GOOD = {"prompt": "Q?", "chosen": " yes", "rejected": " no"}


@pytest.mark.parametrize("row, fragments", [
    ({"prompt": "Q?", "chosen": " yes"}, ("row 2", "'rejected' is missing")),
    ({"prompt": "Q?", "chosen": " same", "rejected": " same"}, ("row 2", "'chosen' and 'rejected' are the same")),
    ({"prompt": "x" * 200, "chosen": " a", "rejected": " b"}, ("row 2", "the prompt is 200 tokens", "--seq-len 128")),
    ({"prompt": "Q?", "chosen": " yes", "rejected": 3}, ("row 2", "must be all strings or all message lists")),
])
def test_check_refuses_a_bad_row_naming_it(tmp_path, row, fragments):
    rows = [GOOD, row, GOOD]
    if "rejected" not in row:  # a column missing in one row: datasets fills it with null
        rows = [GOOD, {**row, "rejected": None}, GOOD]
    refused(dpo_check(tmp_path, rows), 2, *fragments)


def test_check_refuses_an_odd_micro_batch_and_accepts_the_shipped_pairs(tmp_path):
    refused(dpo_check(tmp_path, mbs=3), 1, '"train_micro_batch_size_per_gpu" is 3 rows', "must be even", "use 4")
    result = dpo_check(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("args, fragment", [
    (["--sp", "2"], "sp 1"), (["--tiled-loss", "on"], "--tiled-loss off"), (["--packing"], "drop --packing"),
    (["--train-on", "all"], "drop --train-on"), (["--drop-long"], "drop --drop-long"),
])
def test_check_refuses_what_dpo_does_not_combine_with(tmp_path, args, fragment):
    refused(dpo_check(tmp_path, None, *args), 1, "--objective dpo", fragment)


def test_preference_rows_without_dpo_are_refused(tmp_path):
    refused(train_cli(tmp_path, "--format", "preference", "--check", data=PAIRS), 1, "--objective dpo")
    # --format auto: the first row's columns say so before any rank starts (the ranks would refuse after the launch)
    refused(train_cli(tmp_path, "--check", data=PAIRS), 1, "the data holds preference rows", "add --objective dpo")


def test_the_reference_cache_is_keyed_by_rows_and_model_and_refuses_a_wrong_shape(tmp_path):
    from types import SimpleNamespace

    from toolkit.train.preference import reference

    rows = [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"} for i in range(4)]
    prepared, _ = prepare(tmp_path, rows, eval_fraction=0.25)
    args = SimpleNamespace(model="tiny-gpt2", seed=1234, attention="sdpa", task="causal-lm")
    key = reference.cache_key(prepared.train, prepared.eval, args, {})
    assert key == reference.cache_key(prepared.train, prepared.eval, args, {})
    assert key != reference.cache_key(prepared.train, prepared.eval, SimpleNamespace(**{**vars(args), "seed": 1}), {})
    assert key != reference.cache_key(prepared.train, prepared.eval, args, {"bf16": {"enabled": True}})
    assert key != reference.cache_key(prepared.eval, prepared.train, args, {})
    path = tmp_path / "ref.pt"
    reference.write_cached(path, {"train": torch.arange(6.0), "eval": torch.arange(2.0)})
    assert reference.read_cached(path, 6, 2)["train"].tolist() == [0, 1, 2, 3, 4, 5]
    assert reference.read_cached(path, 8, 2) is None and reference.read_cached(tmp_path / "none.pt", 6, 2) is None
    with_ref = prepared.train.with_reference(torch.arange(6.0))
    assert with_ref.batch([2])[1][1].tolist() == [4.0, 5.0] and with_ref.head(1).ref.tolist() == [0.0, 1.0]


def test_check_refuses_a_moe_router_aux_loss_it_would_drop(tmp_path, saved_models):
    model = tmp_path / "moe_like"
    import shutil

    shutil.copytree(saved_models.get("tiny-gpt2"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    result = train_cli(tmp_path, "--objective", "dpo", "--check", "--seq-len", "128", "--model", str(model), data=PAIRS)
    refused(result, 1, "output_router_logits", "DPO loss")


def test_eval_data_holds_its_own_pairs(tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"H{i}?", "chosen": " a", "rejected": " b"}) + "\n" for i in range(3)))
    tok = hf.byte_tokenizer()
    opts = data.DataOptions(path=str(PAIRS), seq_len=128, eval_data=str(held), cache_dir=str(tmp_path / "c"))
    prepared = data.prepare(opts, tok, quiet=True)
    assert (len(prepared.train), len(prepared.eval)) == (256, 3) and prepared.info["eval_rows"] == 6
    (ids, _), _ = prepared.eval.batch([2])
    assert tok.decode(ids[0][:3]) == "H2?" and tok.decode(ids[1][:3]) == "H2?"
