"""Local text / JSONL -> fixed-length token batches, sharded per data-parallel rank.

Formats, recognised from the file:
  *.txt (any non-JSONL)            documents separated by blank lines; packed (causal LM)
  JSONL {"text": ...}              one document per line; packed (causal LM)
  JSONL {"prompt": .., "response": ..}  one example per row, padded; loss on the response only
  JSONL {"text": .., "label": int} sequence classification (task="classification"); padded

Order: epoch e shuffles the N training rows with torch.randperm(N, seed + e), the recipe of
torch's DistributedSampler, and dp rank r reads positions r, r + dp, r + 2dp, ... So the rows of
global step s are perm[s*gbs:(s+1)*gbs] whatever dp is, and no two replicas share a row.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import ConfigError, UnusableInput

IGNORE_INDEX = -100  # label value the loss skips (HF and torch cross_entropy convention)


@dataclass
class TokenData:
    """N fixed-length rows. input_ids, attention_mask: (N, T) int64; labels (N, T) or (N,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx) -> "TokenData":
        idx = torch.as_tensor(idx, dtype=torch.long)
        return TokenData(self.input_ids[idx], self.attention_mask[idx], self.labels[idx])

    def as_batch(self):
        """The (inputs, labels) pair a PipelineModule's data iterator yields."""
        return (self.input_ids, self.attention_mask), self.labels


TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json")


def read_records(path, encoding: str = "utf-8") -> list:
    """Documents (str) from plain text, or dicts from JSONL. Unreadable input -> UnusableInput that
    names the file and the way out: missing, a directory, binary, not `encoding`, empty, unknown kind."""
    path = check_path(path)
    text = decode_text(path.read_bytes(), path, encoding)
    if not text.strip():
        raise UnusableInput(f"data file {str(path)!r} is empty; it needs text or JSONL rows to train on")
    if path.suffix.lower() in JSON_SUFFIXES:
        return [_json_line(line, path, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    return [doc.strip() for doc in text.split("\n\n") if doc.strip()]


def check_path(path) -> Path:
    """The data file, if it is one dstk can read (exists, a file, a known extension)."""
    path = Path(path)
    if path.is_dir():
        raise UnusableInput(f"--data {path} is a directory; pass a .txt or .jsonl file")
    if not path.is_file():
        raise UnusableInput(f"data file {str(path)!r} does not exist; pass --data PATH to a .txt or .jsonl file")
    if path.suffix.lower() not in TEXT_SUFFIXES + JSON_SUFFIXES:
        raise UnusableInput(f"--data {path}: unknown format {path.suffix or '(no extension)'!r}; dstk train reads "
                            f"plain text ({', '.join(TEXT_SUFFIXES)}) or JSON lines ({', '.join(JSON_SUFFIXES)}): "
                            "rename or convert the file")
    return path


def decode_text(raw: bytes, path: Path, encoding: str = "utf-8") -> str:
    """The file's text, strictly: a byte that is not `encoding` is refused with its offset (training on
    replacement characters teaches the model garbage), NUL bytes mean binary data."""
    nul = raw.find(b"\x00")
    if nul >= 0 and not encoding.lower().replace("-", "").startswith(("utf16", "utf32")):
        raise UnusableInput(f"--data {path}: binary data (a NUL byte at offset {nul}), not text; "
                            "pass a .txt or .jsonl file")
    try:
        return raw.decode("utf-8-sig" if encoding.lower() in ("utf-8", "utf8") else encoding)
    except LookupError:
        raise UnusableInput(f"--encoding {encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, "
                            "cp1252, utf-16)") from None
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UnusableInput(f"--data {path} is not {encoding} text: byte 0x{raw[exc.start]:02x} at offset "
                            f"{exc.start} (line {line}); pass --encoding with the "
                            f"file's encoding (e.g. --encoding latin-1), or convert it: "
                            f"iconv -f LATIN1 -t UTF-8 {path} > {path.stem}.utf8{path.suffix}") from None


def _json_line(line: str, path: Path, lineno: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UnusableInput(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one object") from None
    if not isinstance(record, dict):
        raise UnusableInput(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    return record


def tokenize(records, tokenizer, seq_len: int, task: str = "causal-lm", max_positions=None,
             text_field: str = "text") -> TokenData:
    """Records -> TokenData of rows of seq_len tokens, packed or padded as the format says."""
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than the model's {max_positions} positions "
            f"(max_position_embeddings); use --seq-len {max_positions} or less"
        )
    if task == "classification":
        return _classification(records, tokenizer, seq_len, text_field)
    if records and isinstance(records[0], dict) and "prompt" in records[0]:
        return _prompt_response(records, tokenizer, seq_len)
    docs = [r if isinstance(r, str) else _text(r, text_field, n) for n, r in enumerate(records, 1)]
    return _packed(docs, tokenizer, seq_len)


def _field(record: dict, key: str, n: int):
    if key not in record:
        raise ConfigError(f"JSONL row {n} has no {key!r} field (keys: {sorted(record)}); "
                          f"use --text-field, or rows with 'prompt' and 'response'")
    return record[key]


def _text(record: dict, key: str, n: int) -> str:
    value = _field(record, key, n)
    if not isinstance(value, str):
        raise ConfigError(f"JSONL row {n}: {key!r} is {type(value).__name__} {json.dumps(value)[:40]}, not a string; "
                          f"fix the row, or point --text-field at the field that holds the text")
    return value


def _eos(tokenizer) -> list:
    """The separator appended to each document: eos, else sep, else nothing."""
    token = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return [] if token is None else [token]


def _packed(docs, tokenizer, seq_len: int) -> TokenData:
    """Concatenate documents (each + eos) and cut into rows of seq_len; the tail is dropped."""
    stream = []
    for doc in docs:
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + _eos(tokenizer)
    rows = len(stream) // seq_len
    if rows == 0:
        raise ConfigError(f"the data holds {len(stream)} tokens, fewer than one row of --seq-len {seq_len}; "
                          f"add text or lower --seq-len")
    ids = torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
    return TokenData(ids, torch.ones_like(ids), ids.clone())


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos(tokenizer)[0]


def _prompt_response(records, tokenizer, seq_len: int) -> TokenData:
    """One row per example: prompt + response + eos, padded; labels -100 outside the response."""
    ids, mask, labels = [], [], []
    for n, r in enumerate(records, 1):
        prompt = tokenizer(_text(r, "prompt", n), add_special_tokens=False)["input_ids"]
        answer = tokenizer(_text(r, "response", n), add_special_tokens=False)["input_ids"] + _eos(tokenizer)
        if len(prompt) >= seq_len:
            raise ConfigError(f"JSONL row {n}: the prompt alone is {len(prompt)} tokens, leaving no room for "
                              f"the response in --seq-len {seq_len}; raise --seq-len or shorten the prompt")
        row = (prompt + answer)[:seq_len]
        pad = seq_len - len(row)
        ids.append(row + [_pad_id(tokenizer)] * pad)
        mask.append([1] * len(row) + [0] * pad)
        labels.append([IGNORE_INDEX] * len(prompt) + row[len(prompt):] + [IGNORE_INDEX] * pad)
    return TokenData(*(torch.tensor(x, dtype=torch.long) for x in (ids, mask, labels)))


def _classification(records, tokenizer, seq_len: int, text_field: str) -> TokenData:
    """{"text", "label": int} rows -> padded/truncated to seq_len; labels (N,)."""
    texts = [_text(r, text_field, n) for n, r in enumerate(records, 1)]
    labels = [_field(r, "label", n) for n, r in enumerate(records, 1)]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in labels):
        raise ConfigError("classification rows need an integer 'label' >= 0 (a class index)")
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    return TokenData(enc["input_ids"].long(), enc["attention_mask"].long(), torch.tensor(labels))


def split(data: TokenData, eval_fraction: float, seed: int):
    """(train, eval): a seeded shuffle, the first ceil(N * eval_fraction) rows go to eval."""
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    n_eval = min(len(data) - 1, int(-(-len(data) * eval_fraction // 1))) if eval_fraction > 0 else 0
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    return data.rows(perm[n_eval:]), data.rows(perm[:n_eval])


class ShardedBatches:
    """Micro-batches of one data-parallel rank: mbs rows each, gas of them per optimizer step.

    Every rank of a dp group (all pipeline stages of one replica) gets the same stream, as
    DeepSpeed's pipeline needs: the first stage reads the inputs, the last stage the labels.
    """

    def __init__(self, data: TokenData, mbs: int, gas: int, dp: int, dp_rank: int, seed: int):
        self.data, self.mbs, self.gas, self.dp, self.dp_rank, self.seed = data, mbs, gas, dp, dp_rank, seed
        self.gbs = mbs * gas * dp
        self.steps_per_epoch = len(data) // self.gbs  # drop_last: a step never mixes epochs
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the training split has {len(data)} rows, fewer than one global batch "
                f"mbs({mbs}) * gas({gas}) * dp({dp}) = {self.gbs}; add data, lower --seq-len or the batch"
            )

    def epoch_rows(self, epoch: int) -> torch.Tensor:
        """This rank's row indices for an epoch, in order: (steps_per_epoch * mbs * gas,)."""
        g = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's recipe
        perm = torch.randperm(len(self.data), generator=g)[: self.steps_per_epoch * self.gbs]
        return perm[self.dp_rank :: self.dp]

    def micro_batches(self, start_step: int = 0):
        """Endless (inputs, labels) micro-batches from optimizer step start_step on (for resume)."""
        epoch, step = divmod(start_step, self.steps_per_epoch)
        first = step * self.gas  # micro-batch index inside the epoch
        while True:
            rows = self.epoch_rows(epoch)
            for k in range(first, self.steps_per_epoch * self.gas):
                yield self.data.rows(rows[k * self.mbs : (k + 1) * self.mbs]).as_batch()
            epoch, first = epoch + 1, 0


def eval_micro_batches(data: TokenData, mbs: int, dp: int, dp_rank: int, count: int):
    """count micro-batches of the eval split for this rank, in file order, wrapping around."""
    if len(data) == 0:
        return
    order = torch.arange(len(data))[dp_rank::dp] if len(data) >= dp else torch.arange(len(data))
    for k in range(count):
        idx = [(k * mbs + j) % len(order) for j in range(mbs)]
        yield data.rows(order[idx]).as_batch()
