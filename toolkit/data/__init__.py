"""--data -> this rank's batches: sources, row formats, packing, batches.

    source.py    local files / save_to_disk folders -> a datasets.Dataset, checked before any rank starts
    formats.py   text, prompt-completion, chat, alpaca, sharegpt rows -> token ids and labels, a batch at a time
    chat.py      chat rows -> checked messages -> the template's text and the assistant turns in it
    tokens.py    a batch of strings -> ids at the tokenizer's own speed; ragged ids <-> Arrow; the preparing rank's progress line (rows/s, ETA)
    pack.py      documents -> fixed-length rows (packed with document ids, or padded), NumPy over batches
    batches.py   this rank's micro-batches: order, resume, whole-split eval
    prepared.py  the whole preparation (tokenize, split, pack; cached, once per node): prepare, DataOptions
    fingerprint.py  the content of every input of the token stream, as a resume compares it with its checkpoint
    stream.py    --streaming: rows read from --data as they are needed, tokenized on a prefetch thread
    transfer.py  batches to the accelerator: pinned memory, non-blocking copies, the prefetch thread

`from toolkit import data` gives prepared.py's names (data.prepare, data.DataOptions, data.ShardedBatches,
...), loaded on first use: checking a --data file (source.py) before launch imports no torch.
"""

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("toolkit.data.prepared"), name)
