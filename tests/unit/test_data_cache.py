"""The data cache (issue 30): its key covers what changes tokens (tokenizer files, chat template, format,
seq-len, packing, train-on), and nothing else; a warm prepare tokenizes nothing. A real BPE tokenizer,
trained here with `tokenizers` as a user's own would be, saved to and loaded from files."""

import json

import pytest

from toolkit import data
from toolkit.data import tokens
from toolkit.train import hf

CORPUS = hf.__file__.rsplit("/", 3)[0] + "/toolkit/corpus/corpus.txt"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE (vocabulary 600) trained on the shipped corpus, saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(open(CORPUS, encoding="utf-8").read().split("\n\n"), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    folder = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(folder)
    return folder


def load(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """mixed.jsonl: rows with text, prompt and completion (two formats); chat.jsonl: conversations."""
    folder = tmp_path_factory.mktemp("data")
    paragraphs = open(CORPUS, encoding="utf-8").read().split("\n\n")[:120]
    with open(folder / "mixed.jsonl", "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p, "prompt": p[:40], "completion": p[40:]}) + "\n")
    with open(folder / "chat.jsonl", "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"messages": [{"role": "user", "content": p[:50]},
                                             {"role": "assistant", "content": p[50:]}]}) + "\n")
    return folder


def cache_files(cache) -> set:
    return {p.name for p in (cache / "dstk").glob("*.arrow")}


def prepare(path, tok, cache, **kw):
    """prepare(), and the cache files it made: {"tokens": n, "rows": n} new files."""
    before = cache_files(cache) if (cache / "dstk").exists() else set()
    kw.setdefault("seq_len", 64)
    prepared = data.prepare(data.DataOptions(str(path), cache_dir=str(cache), **kw), tok)
    new = cache_files(cache) - before
    return prepared, {kind: sum(n.startswith(kind) for n in new) for kind in ("tokens", "rows")}


def rows(prepared):
    return [split.batch(range(len(split)))[0][0].tolist() for split in (prepared.train, prepared.eval)]


CHANGES = [  # (what, data file, options before, options after, tokenizer change, new token files, new row files)
    # packed rows are written (train, eval); unpacked ones (supervised formats' default) are documents of the
    # tokens file, chosen again at every start (pack.unpacked): no file of their own
    ("seq-len", "mixed.jsonl", {"format": "text"}, {"format": "text", "seq_len": 32}, None, 0, 2),
    ("packing", "mixed.jsonl", {"format": "text"}, {"format": "text", "packing": False}, None, 0, 0),
    ("format", "mixed.jsonl", {"format": "text"}, {"format": "prompt-completion"}, None, 1, 0),
    ("train-on", "chat.jsonl", {}, {"train_on": "all"}, None, 1, 0),
    ("template", "chat.jsonl", {}, {}, "template", 1, 0),
    ("tokenizer files", "mixed.jsonl", {"format": "text"}, {"format": "text"}, "vocabulary", 1, 2),
    ("special tokens", "mixed.jsonl", {"format": "text"}, {"format": "text"}, "eos", 1, 2),
]


@pytest.mark.parametrize("what, name, before, after, change, new_tokens, new_rows", CHANGES,
                         ids=[c[0] for c in CHANGES])
def test_a_change_in_each_input_invalidates(tmp_path, bpe_dir, files, what, name, before, after, change,
                                            new_tokens, new_rows):
    cache = tmp_path / "cache"
    first, made = prepare(files / name, load(bpe_dir), cache, **before)
    assert made == {"tokens": 1, "rows": 2 if first.info["packing"] else 0}  # tokens, then train and eval rows
    tok = load(bpe_dir)
    if change == "template":
        tok.chat_template = CHATML.replace("<|im_end|>\n", "<|im_end|>\n\n")
    elif change == "vocabulary":  # the tokenizer's files changed on disk: one merge fewer
        spec = json.loads((bpe_dir / "tokenizer.json").read_text())
        spec["model"]["merges"] = spec["model"]["merges"][:-1]
        changed = tmp_path / "changed"
        tok.save_pretrained(changed)
        (changed / "tokenizer.json").write_text(json.dumps(spec))
        tok = load(changed)
    elif change == "eos":
        tok.eos_token = "<|im_end|>"
    second, made = prepare(files / name, tok, cache, **after)
    assert made == {"tokens": new_tokens, "rows": new_rows}, what


SAME = [  # what does not change tokens: a warm start, whatever else differs
    ("tokenizer loaded again", "mixed.jsonl", {"format": "text"}, {}),
    ("data workers", "mixed.jsonl", {"format": "text", "workers": 2}, {}),
    ("max positions", "mixed.jsonl", {"format": "text", "max_positions": 4096}, {}),
    ("text field on chat data", "chat.jsonl", {"text_field": "body"}, {}),
    ("template on text data", "mixed.jsonl", {"format": "text"}, {"template": True}),
    ("tokenizer.json truncation", "mixed.jsonl", {"format": "text"}, {"truncation": True}),
]


@pytest.mark.parametrize("what, name, options, change", SAME, ids=[s[0] for s in SAME])
def test_nothing_else_invalidates_and_a_warm_prepare_tokenizes_nothing(tmp_path, bpe_dir, files, what, name,
                                                                        options, change, monkeypatch):
    cache = tmp_path / "cache"
    base = {k: v for k, v in options.items() if k in ("format",)}
    first, _ = prepare(files / name, load(bpe_dir), cache, **base)
    tok = load(bpe_dir)
    if change.get("template"):
        tok.chat_template = CHATML.replace("<|im_end|>\n", "<|im_end|>\n\n")
    if change.get("truncation"):
        tok.backend_tokenizer.enable_truncation(8)
    monkeypatch.setattr(tokens, "encode", lambda *a, **k: pytest.fail("tokenized again"))
    second, made = prepare(files / name, tok, cache, **options)
    assert made == {"tokens": 0, "rows": 0}, what
    assert rows(second) == rows(first)


def test_a_tokenizer_json_truncation_does_not_cut_documents(tmp_path, bpe_dir, files):
    """The HF call turns a tokenizer.json's truncation off; dstk's batched call must too."""
    tok = load(bpe_dir)
    tok.backend_tokenizer.enable_truncation(8)
    got, _ = prepare(files / "mixed.jsonl", tok, tmp_path / "cache", format="text", packing=False, seq_len=512,
                     eval_fraction=0.0)
    (ids, _), _ = got.train.batch(range(len(got.train)))
    assert (ids != tok.pad_token_id).sum(axis=1).max() > 9


def test_batched_ids_equal_the_tokenizers_own_call_per_document(bpe_dir, files):
    tok = load(bpe_dir)
    texts = [json.loads(line)["text"] for line in open(files / "mixed.jsonl")]
    assert [e.ids for e in tokens.encode(tok, texts, threads=3)] == [tok(t, add_special_tokens=False)["input_ids"]
                                                                     for t in texts]


def test_tokenizing_reports_rows_per_second_and_an_eta_in_a_log_and_nothing_when_warm(tmp_path, bpe_dir, files,
                                                                                        capsys, monkeypatch):
    monkeypatch.setenv("DSTK_PROGRESS_SECONDS", "0")  # a line per batch (a log file: stderr is no terminal)
    monkeypatch.setattr(data.prepared, "TOKENIZE_BATCH", 40)  # 120 rows: 3 batches
    prepare(files / "mixed.jsonl", load(bpe_dir), tmp_path / "cache", format="text")
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if line.startswith("preparing --data: tokenizing mixed.jsonl: ")]
    assert len(progress) == 4 and "\r" not in "".join(progress), lines
    assert [line.split(": ")[2].split(" rows")[0] for line in progress[:3]] == ["40 / 120", "80 / 120", "120 / 120"]
    assert all("rows/s" in line and "M tokens/s" in line and "ETA " in line for line in progress[:3])
    assert progress[3].startswith("preparing --data: tokenizing mixed.jsonl: 120 rows, ")
    prepare(files / "mixed.jsonl", load(bpe_dir), tmp_path / "cache", format="text")
    assert "preparing --data" not in capsys.readouterr().err  # a warm cache tokenizes nothing


def test_on_a_terminal_the_line_is_rewritten_in_place():
    import io

    from toolkit.data.tokens import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    progress = Progress("preparing --data: tokenizing x", 1000, stream=out)
    progress.last -= 1  # half a second has passed
    progress.update(250, 5000)
    progress.close()
    text = out.getvalue()
    assert text.startswith("\rpreparing --data: tokenizing x: 250 / 1,000 rows (25.0%)") and text.endswith("\n")
    assert text.count("\n") == 1 and "ETA" in text


def test_a_text_file_is_read_through_once_per_version_not_on_every_rank_and_start(tmp_path, bpe_dir, monkeypatch):
    from toolkit.data import source

    path = tmp_path / "corpus.txt"
    path.write_text(open(CORPUS, encoding="utf-8").read())
    reads = []
    check = source.check_text
    monkeypatch.setattr(source, "check_text", lambda *a, **k: reads.append(k.get("limit")) or check(*a, **k))
    for _ in range(2):  # the preparing rank, then a waiting rank (or a warm start)
        prepare(path, load(bpe_dir), tmp_path / "cache")
    assert reads.count(None) == 1  # the whole file once (each start still looks at its first MiB)
    path.write_text(path.read_text() + "\n\nOne more paragraph.\n")  # a new version is read through again
    prepare(path, load(bpe_dir), tmp_path / "cache")
    assert reads.count(None) == 2


def test_a_changed_data_file_invalidates_and_its_new_rows_are_read(tmp_path, bpe_dir, files):
    path, cache = tmp_path / "data.jsonl", tmp_path / "cache"
    path.write_text((files / "mixed.jsonl").read_text())
    first, made = prepare(path, load(bpe_dir), cache, format="text")
    assert made == {"tokens": 1, "rows": 2}
    with open(path, "a") as f:
        f.write(json.dumps({"text": "One more document, with words the others never had.", "prompt": "", "completion": ""})
                + "\n")
    second, made = prepare(path, load(bpe_dir), cache, format="text")
    assert made == {"tokens": 1, "rows": 2}
    assert second.info["documents"] == first.info["documents"] + 1


@pytest.mark.parametrize("name, fmt", [("mixed.jsonl", "text"), ("chat.jsonl", "chat")])
def test_rows_do_not_depend_on_batches_and_the_read_ahead(tmp_path, bpe_dir, files, monkeypatch, name, fmt):
    """Text batches and chat chunks are tokenized ahead while the last batch is written (formats.read_ahead):
    batches of 7 rows, chunks of 3 give the rows one batch gives."""
    from toolkit.data import formats, prepared

    def everything(p):
        return [split.batch(range(len(split))) for split in (p.train, p.eval)]

    whole, _ = prepare(files / name, load(bpe_dir), tmp_path / "one", format=fmt)
    used, real = [], formats.Encoder._ahead
    monkeypatch.setattr(prepared, "TOKENIZE_BATCH", 7)
    monkeypatch.setattr(formats, "CHAT_CHUNK", 3)
    monkeypatch.setattr(formats.Encoder, "_ahead", lambda self, indices: (lambda got: used.append(got is not None)
                                                                          or got)(real(self, indices)))
    cut, _ = prepare(files / name, load(bpe_dir), tmp_path / "cut", format=fmt)
    assert sum(used) >= 15 and sum(used) >= len(used) - 1, "the batches were not read ahead"
    for ((ids_a, docs_a), labels_a), ((ids_b, docs_b), labels_b) in zip(everything(whole), everything(cut)):
        assert ids_a.equal(ids_b) and docs_a.equal(docs_b) and labels_a.equal(labels_b)
