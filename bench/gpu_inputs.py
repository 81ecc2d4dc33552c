"""What bench/gpu_finetune.py's cases train on: one saved model directory and two data files.

The model: a built-in architecture (llama-3.2-1b's published dimensions; tiny-llama for the dry run) with
the vocabulary of dstk's byte tokenizer, as `dstk train --model NAME` would build it, but random weights
saved in bf16 with save_pretrained, next to the tokenizer (with a ChatML chat template for the chat case).
Every case passes this directory as --model: the real path of a pretrained model (weights read from disk,
cast by the trainer; --qlora quantizes them as they load, which it can only do from a directory).

The data: the shipped corpus as text (packed by default), and the same stories as chat rows (a user turn
asks for the story, the assistant tells it; `--packing` packs them, the loss on the assistant's tokens).
"""

import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def config_and_tokenizer(model: str):
    """(HF config, tokenizer) of built-in `model` exactly as `dstk train --model NAME` makes them (the byte
    tokenizer's 257-entry vocabulary, dropout off), the tokenizer given a ChatML template."""
    from toolkit.train import hf

    tokenizer = hf.byte_tokenizer()
    tokenizer.chat_template = CHATML
    return hf.builtin_config(model, tokenizer), tokenizer


def save_model(model: str, work: Path, seed: int = 0, blocks: int | None = None) -> Path:
    """WORK/MODEL: built-in `model` with random weights from `seed`, saved in bf16 (save_pretrained), and
    its tokenizer. About 2.5 GB and 20-60 s on CPU for the ~1B model. `blocks`: its widths with that many decoder
    blocks (WORK/MODEL-Nblocks)."""
    import torch
    from transformers import AutoModelForCausalLM

    config, tokenizer = config_and_tokenizer(model)
    path = work / model
    if blocks is not None:
        config.num_hidden_layers, path = blocks, work / f"{model}-{blocks}blocks"
        if isinstance(getattr(config, "layer_types", None), list):  # one entry per block: those kept
            config.layer_types = config.layer_types[:blocks]
    torch.manual_seed(seed)
    built = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    built.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del built
    return path


def _stories() -> list[str]:
    return [s.strip() for s in CORPUS.read_text().split("\n\n") if s.strip()]


def text_file(tokens: int, work: Path) -> Path:
    """The shipped corpus, repeated into WORK/corpus.txt when it holds fewer than `tokens` bytes (the byte
    tokenizer: one token per byte) plus 10% for the packing's end-of-text tokens and remainders."""
    text = CORPUS.read_text()
    repeats = math.ceil(tokens * 1.1 / len(text.encode()))
    if repeats <= 1:
        return CORPUS
    path = work / "corpus.txt"
    path.write_text("\n\n".join([text.strip()] * repeats) + "\n")
    return path


def chat_file(tokens: int, work: Path) -> Path:
    """WORK/chat.jsonl: {"messages": [user, assistant]} rows made from the corpus's stories (the user gives
    a story's first sentence, the assistant the rest), each story once, cycled further until they hold `tokens` tokens plus 10% (rendered in ChatML)."""
    rows, size, stories = [], 0, _stories()
    while size < tokens * 1.1 or len(rows) < len(stories):  # every story at least once: rows for a short run too
        story = stories[len(rows) % len(stories)]
        first, _, rest = story.partition(". ")
        row = {"messages": [{"role": "user", "content": f"Tell me the story that begins: {first}."},
                            {"role": "assistant", "content": rest}]}
        rows.append(json.dumps(row))
        size += sum(len(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n".encode()) for m in row["messages"])
    path = work / "chat.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path
