"""Input types and row formats: every file kind reads alike, chat masks cover exactly the assistant
tokens, alpaca/sharegpt map to chat, malformed rows are refused with the file and the row."""

import json

import pytest

import toolkit.data.chat as chat

from toolkit.errors import ConfigError, UnusableInput
from toolkit import data
from toolkit.data.chat import render_chat
from toolkit.train.hf import byte_tokenizer

# ChatML with HF's generation markers, so apply_chat_template(return_assistant_tokens_mask=True) can check us
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
          "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
TEXTS = ["the first document", "a second one", "and a third"]


@pytest.fixture()
def tok():
    t = byte_tokenizer()
    t.chat_template = CHATML
    return t


def _prepare(path, tok, tmp_path, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return data.prepare(data.DataOptions(str(path), kw.pop("seq_len", 64), cache_dir=str(tmp_path / "cache"), **kw),
                        tok)


def _rows(split):
    (ids, docs), labels = split.batch(range(len(split)))
    return ids.tolist(), docs.tolist(), labels.tolist()


def _write_all_kinds(tmp_path) -> dict:
    import datasets

    ds = datasets.Dataset.from_dict({"text": TEXTS})
    paths = {"txt": tmp_path / "d.txt", "jsonl": tmp_path / "d.jsonl", "json": tmp_path / "d.json",
             "parquet": tmp_path / "d.parquet", "csv": tmp_path / "d.csv", "arrow": tmp_path / "saved_arrow",
             "disk": tmp_path / "saved"}
    paths["txt"].write_text("\n\n".join(TEXTS) + "\n")
    paths["jsonl"].write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    paths["json"].write_text(json.dumps([{"text": t} for t in TEXTS]))
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.save_to_disk(str(paths["disk"]))
    paths["arrow"] = next(paths["disk"].glob("*.arrow"))  # an Arrow stream file as save_to_disk writes it
    return paths


def test_every_input_kind_gives_the_same_rows(tmp_path, tok):
    rows = {kind: _rows(_prepare(path, tok, tmp_path).train) for kind, path in _write_all_kinds(tmp_path).items()}
    assert all(r == rows["txt"] for r in rows.values()), rows
    assert rows["txt"][1][0][:3] == [1, 1, 1] and max(rows["txt"][1][0]) == 3  # three documents packed in one row


def test_a_hub_name_is_refused_locally(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnusableInput, match="looks like a hub dataset name.*save_to_disk"):
        _prepare("HuggingFaceH4/ultrachat_200k", tok, tmp_path)


@pytest.mark.parametrize("row, fmt", [
    ({"text": "x"}, "text"), ({"prompt": "p", "completion": "c"}, "prompt-completion"),
    ({"prompt": "p", "response": "c"}, "prompt-completion"), ({"messages": CHAT}, "chat"),
    ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "sharegpt"),
])
def test_the_format_is_inferred_from_the_columns_and_said(tmp_path, tok, row, fmt):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    info = _prepare(path, tok, tmp_path, seq_len=256).info
    assert info["format"] == fmt and f"format {fmt} inferred from the column" in info["how"]


def test_ambiguous_columns_ask_for_format(tmp_path, tok):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"text": "x", "messages": CHAT}) + "\n")
    with pytest.raises(ConfigError, match="matches several formats: chat, text; pass --format"):
        _prepare(path, tok, tmp_path)
    assert _prepare(path, tok, tmp_path, format="text").info["how"] == "format text (--format)"


def test_chat_loss_mask_is_exactly_the_templates_assistant_tokens(tmp_path, tok):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    ids, docs, labels = _rows(_prepare(path, tok, tmp_path, seq_len=256).train)
    ref = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    n = len(ref["input_ids"])
    assert ids[0][:n] == ref["input_ids"] and docs[0] == [1] * n + [0] * (256 - n)
    assert [y != -100 for y in labels[0][:n]] == [bool(m) for m in ref["assistant_masks"]]
    trained = bytes(t for t, y in zip(ids[0], labels[0]) if y != -100).decode()
    assert trained == "Hello.<|im_end|>\n4<|im_end|>\n"
    everything = _rows(_prepare(path, tok, tmp_path, seq_len=256, train_on="all").train)[2]
    assert everything[0][1:n] == ref["input_ids"][1:]


def test_alpaca_and_sharegpt_render_as_the_same_chat(tmp_path, tok):
    chat = [{"role": "user", "content": "Name a color.\n\nOne word."}, {"role": "assistant", "content": "Red"}]
    rows = {"chat": {"messages": chat},
            "alpaca": {"instruction": "Name a color.", "input": "One word.", "output": "Red"},
            "sharegpt": {"conversations": [{"from": "human", "value": "Name a color.\n\nOne word."},
                                           {"from": "gpt", "value": "Red"}]}}
    got = {}
    for name, row in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        got[name] = _rows(_prepare(path, tok, tmp_path, seq_len=128).train)
    assert got["alpaca"] == got["chat"] == got["sharegpt"]


@pytest.mark.parametrize("messages, fragment", [
    ([{"content": "hi"}, {"role": "assistant", "content": "x"}], "row 2: message 1 has no 'role'"),
    ([], "row 2: 'messages' is empty"),
    ([{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}], "row 2: message 1 (user) 'content' is int"),
    ([{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}], "row 2: message 1 (user) 'content'"),
    ([{"role": "robot", "content": "hi"}], "row 2: message 1 has role 'robot'"),
])
def test_malformed_chat_rows_are_refused_with_file_and_row(tmp_path, tok, messages, fragment):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(UnusableInput) as info:
        _prepare(path, tok, tmp_path)
    assert "bad.jsonl" in str(info.value) and fragment in str(info.value), str(info.value)


def test_chat_without_a_template_names_the_flag(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(ConfigError, match="no chat template.*--chat-template FILE"):
        _prepare(path, byte_tokenizer(), tmp_path)


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ConfigError, match="not a prefix of the whole.*--chat-template FILE"):
        render_chat(CHAT, tok, "f.jsonl", 3)


def test_long_chat_rows_are_truncated_or_dropped_and_counted(tmp_path, tok):
    path = tmp_path / "long.jsonl"
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    long = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 100}]
    path.write_text("\n".join(json.dumps({"messages": m}) for m in (short, long, short)))
    cut = _prepare(path, tok, tmp_path, seq_len=80)
    assert len(cut.train) == 3 and cut.info["long"] == 1 and "truncated" in cut.info["long_policy"]
    dropped = _prepare(path, tok, tmp_path, seq_len=80, drop_long=True)
    assert len(dropped.train) == 2 and "dropped" in dropped.info["long_policy"]
    packed = _prepare(path, tok, tmp_path, seq_len=130, packing=True, drop_long=True)
    assert len(packed.train) == 1 and _rows(packed.train)[1][0].count(2) > 0  # two chats in one row


def test_a_template_raising_on_one_row_of_a_file_is_refused_by_that_rows_number(tmp_path, tok):
    """The template renders message by message (the fast path, chat.Segments) until one row's content makes it
    raise: the refusal names the file and that row (rows rendered a chunk at a time, ahead of the tokenizer)."""
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] == 'boom' %}"
                         "{{ raise_exception('no booms') }}{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert chat.segments(tok) is not None  # the fast path
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": "a"}]}
            for n in range(600)]
    rows[433]["messages"][1]["content"] = "boom"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UnusableInput, match=r"chat.jsonl row 434: the chat template failed.*no booms"):
        _prepare(path, tok, tmp_path)
