"""Chat rows' tokens and loss mask on every path the encoder can take are the reference's: the whole render
(apply_chat_template, every turn's prefix rendered) tokenized with character offsets, a token trained where it
starts inside an assistant turn. Paths: messages tokenized alone (chat.Pieces: byte-level BPE, a template that
renders message by message and starts each with a special token), whole renders found from one render
(chat.Segments, any fast tokenizer), every prefix rendered (a template that is not message by message), and a
tokenizer whose tokens do not cover every character (WordPiece: spaces belong to no token)."""

import random

import numpy as np
import pytest

import toolkit.data.chat as chat
import toolkit.data.tokens as tokens
from toolkit.data.formats import IGNORE_INDEX, Encoder

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}"
          "{% set sys = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}{% set messages = messages[1:] %}"
          "{% else %}{% set sys = '' %}{% endif %}"
          "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ (sys if loop.first else '') + "
          "m['content'] }} [/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "café", "日本", "naïve", "—", "42", "x+y", "hello", "world",
         "it's"]
LEADS = ["", "", "", "\n", " ", "\n\n", "  \n", "<|im_end|>", "<|im_start|>", "<|start_header_id|>", "日本", "\t", "1", "?",
         "<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n"]  # a head inside a content


def bpe(kind: str):
    """A tiny trained tokenizer with the chat special tokens added: byte-level BPE, or WordPiece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choices(WORDS, k=rng.randint(3, 30))) + "\n" * rng.randint(0, 3) for _ in range(400)]
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", *SPECIAL], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", pad_token="<|endoftext|>")


def conversations(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                words = " ".join(rng.choices(WORDS, k=rng.randint(0, 12)))
                messages.append({"role": role, "content": rng.choice(LEADS) + words + rng.choice(["", " ", "\n"])})
        out.append(messages)
    return out


def reference(rows: list, tok) -> tuple[list, list]:
    """Per row: ids and labels from the whole render and every token's character offsets."""
    ids, labels = [], []
    for n, messages in enumerate(rows):
        full, spans = chat.chat_spans(messages, tok, "ref", n, chat.renderer(tok), None)
        encoding = tokens.encode(tok, [full], offsets=True)[0]
        ids.append(encoding.ids)
        labels.append(np.where(chat.marks(encoding.offsets, spans), encoding.ids, IGNORE_INDEX).tolist())
    return ids, labels


@pytest.mark.parametrize("kind, template, path", [
    ("bpe", CHATML, "pieces"), ("bpe", LLAMA3, "pieces"), ("bpe", LLAMA2, "prefixes"),
    ("wordpiece", CHATML, "segments"), ("wordpiece", LLAMA2, "prefixes"),
])
def test_every_path_gives_the_reference_tokens_and_mask(kind, template, path):
    tok = bpe(kind)
    tok.chat_template = template
    render = chat.renderer(tok)
    assert {"pieces": chat.pieces(tok, render) is not None, "segments": chat.segments(tok, render) is not None
            and chat.pieces(tok, render) is None, "prefixes": chat.segments(tok, render) is None}[path]
    rows = conversations(300)
    ids, labels = reference(rows, tok)
    out = Encoder("chat", tok, "chat.jsonl", threads=2).columns({"messages": rows}, list(range(len(rows))))
    assert out["input_ids"].to_pylist() == ids
    assert out["labels"].to_pylist() == labels
    assert sum(y != IGNORE_INDEX for row in labels for y in row) > 1000  # replies are trained
    everything = Encoder("chat", tok, "chat.jsonl", "all", threads=2).columns({"messages": rows}, list(range(300)))
    assert everything["labels"].to_pylist() == ids


def test_replies_that_merge_with_the_prompt_are_found_by_offsets():
    """A reply opening with whitespace can merge with the generation prompt's last token (BPE's "\\n\\n"): the
    message's tokens then do not begin with the prompt's, and the row's offsets decide; the Llama 3 template trims
    contents, so rows with padded contents do not render as the pieces and go the whole way."""
    tok = bpe("bpe")
    tok.chat_template = CHATML
    split = chat.pieces(tok)
    engine = tokens.backend(tok)
    row = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n{}the cat<|im_end|>\n"
    merged = [lead for lead in ("\n", "\n\n", "  \n", " ")
              if split.row_spans(engine.encode(row.format(lead), add_special_tokens=False).ids,
                                 [{"role": "user"}, {"role": "assistant"}]) is None]
    assert merged, "no reply merges with the prompt: the offsets fallback is not exercised"
    tok.chat_template = LLAMA3
    model = chat.segments(tok)
    padded = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert model.texts(padded, chat.renderer(tok)(padded, False)) is None
    assert model.texts(padded[1:], chat.renderer(tok)(padded[1:], False)) is not None


def test_segments_are_learned_only_for_templates_that_render_message_by_message():
    tok = bpe("bpe")
    last = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    for template, learned in ((CHATML, True), (LLAMA3, True), (LLAMA2, False), (last, False)):
        tok.chat_template = template
        assert (chat.segments(tok) is not None) is learned, template
    tok.chat_template = LLAMA3
    model = chat.segments(tok)
    assert model.start == "<s>" and model.prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n"
