"""`dstk train --check --objective dpo`: every preference row of --data (and --eval-data) read and tokenized as the
ranks will (encode.py), so a missing field, chosen == rejected or a prompt that leaves no completion token within
--seq-len is refused, naming the row, before any rank starts."""

from toolkit.errors import ConfigError

BATCH = 1000  # rows per call


def check_rows(path: str, tokenizer, seq_len: int, encoding: str = "utf-8", cache_dir: str | None = None,
               fmt: str = "auto", flag: str = "--data") -> int:
    """The number of pairs in `path`, each checked; a refusal names the first bad row."""
    from toolkit.data.formats import infer_format
    from toolkit.data.pairs.encode import encode_pairs
    from toolkit.data.source import load

    ds = load(path, encoding, cache_dir, flag=flag)
    found, _ = infer_format(ds.column_names, "causal-lm", fmt)
    if found != "preference":
        raise ConfigError(f"{flag} {path}: --objective dpo reads preference rows ('prompt', 'chosen', 'rejected'); "
                          f"its columns {sorted(ds.column_names)} are format {found}")
    for start in range(0, len(ds), BATCH):
        rows = range(start, min(start + BATCH, len(ds)))
        encode_pairs(tokenizer, ds[start: rows.stop], list(rows), path, seq_len)
    return len(ds)
