"""One content fingerprint for every input of a run's token stream: --data, --eval-data, the tokenizer's files and
--chat-template. A checkpoint's manifest records them (toolkit.train.job.run_identity) and a resume compares them
(compare, through toolkit.checkpoint.manifest.check_resumable): an input edited in place is refused, the same
content at another path is the same input.

    of_input(path, cache_dir)   prepared inputs: sha256 of the bytes (a folder: of its files by relative name),
                                remembered per version of each file (source.file_key: path, size, mtime, the key
                                the tokenizing cache reads files by) in that cache's folder: a warm start reads no
                                byte, a cold one hashes at ~0.8 GB/s (tokenizing it costs far more)
    of_stream(path)             --streaming: size, mtime and the sha256 of SAMPLES blocks spread over the file; a
                                stream is what does not fit ahead of time, and reading all of it at each start would
                                cost minutes. An edit that keeps the size and the sampled blocks is still caught by
                                its mtime; the price: a copy that does not keep the mtime (cp without -p) reads as
                                changed, and --resume-with-new-data continues it
    digest(paths)               small files (the tokenizer's, the template), by name and bytes
"""

import hashlib
import json
import os
from pathlib import Path

CHUNK = 1 << 22  # bytes read at a time
SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # of_stream: 16 blocks of 64 KiB, the first and last included


def of_input(path, cache_dir: str | None = None, streaming: bool = False) -> dict | None:
    """The fingerprint of --data or --eval-data (None: no such input)."""
    if not path or not Path(path).exists():
        return None
    path = Path(path)
    if streaming:
        return of_stream(path)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file())
        prints = [(str(f.relative_to(path)), _sha256(f, cache_dir)) for f in files]
        body = json.dumps([(name, fp["sha256"]) for name, fp in prints]).encode()
        return {"sha256": hashlib.sha256(body).hexdigest(), "bytes": sum(fp["bytes"] for _, fp in prints)}
    return _sha256(path, cache_dir)


def of_stream(path: Path) -> dict:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(fh.read())
        for i in range(SAMPLES) if size > SAMPLES * SAMPLE_BYTES else ():
            fh.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
            digest.update(fh.read(SAMPLE_BYTES))
    return {"bytes": size, "mtime_ns": path.stat().st_mtime_ns, "sampled_sha256": digest.hexdigest()}


def _sha256(path: Path, cache_dir: str | None) -> dict:
    """{"sha256", "bytes"} of a file, from the cache folder's record of this version of it when there is one."""
    memo = _memo(path, cache_dir)
    if memo is not None and memo.is_file():
        try:
            return json.loads(memo.read_text())
        except (OSError, ValueError):
            pass
    return _hash(path, memo)


def _hash(path: Path, memo: Path | None) -> dict:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    found = {"sha256": digest.hexdigest(), "bytes": size}
    if memo is not None:
        try:  # a record is a convenience: a cache folder that cannot be written costs a hash next time
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
            tmp.write_text(json.dumps(found))
            os.replace(tmp, memo)
        except OSError:
            pass
    return found


def _memo(path: Path, cache_dir: str | None) -> Path | None:
    from toolkit.data.source import cache_root, file_key

    try:
        return cache_root(cache_dir) / f"sha256-{file_key(path, 'sha256')}.json"
    except OSError:
        return None


def digest(paths) -> str:
    """sha256 (first 16 hex digits) over the files that exist among `paths`, named and in order."""
    found = hashlib.sha256()
    for path in map(Path, paths):
        if path.is_file():
            found.update(path.name.encode() + b"\0" + path.read_bytes())
    return found.hexdigest()[:16]


# what a run records of its token stream's inputs: flag -> (where its path is in the manifest, where its content is)
INPUTS = {"--data": (("data", "path"), ("data", "content", "--data")),
          "--eval-data": (("data", "eval_data"), ("data", "content", "--eval-data")),
          "--tokenizer": (("tokenizer",), ("data", "tokenizer_files"))}  # its files' change: data.tokenizer_files


def _at(record: dict, keys: tuple):
    for key in keys:
        record = record.get(key) if isinstance(record, dict) else None
    return record


def compare(saved: dict, now: dict) -> tuple[dict, dict, list]:
    """Between a checkpoint's record and this run's, by content: ({path key: refusal} for --data or --eval-data whose
    content changed, {path key: note} for an input at another path with the same content, notes on what could not
    be compared). Path keys: "data.path", "data.eval_data", "tokenizer". An input either record lacks, or fingerprinted
    another way (--streaming then and not now: that setting differs, and is said), is not compared here."""
    changed, moved, notes = {}, {}, []
    if isinstance(saved.get("data"), dict) and "content" not in saved["data"]:
        notes.append("the checkpoint records no content fingerprint of --data (written by an older dstk): resumed "
                     "on the same path, whose content could not be checked")
    for flag, (path_keys, content_keys) in INPUTS.items():
        was, will = _at(saved, content_keys), _at(now, content_keys)
        old, new = _at(saved, path_keys), _at(now, path_keys)
        if was is None or will is None or type(was) is not type(will) or (
                isinstance(was, dict) and set(was) != set(will)):
            continue
        key = ".".join(path_keys)
        if was == will and old != new and old is not None and new is not None:
            moved[key] = f"{flag} {new} holds what the checkpoint read from {old} (same content): resuming on it"
        elif was != will and flag != "--tokenizer":
            changed[key] = f"{flag} {new}: {_what_changed(was, will, old, new)}"
    return changed, moved, notes


def _what_changed(was, will, old, new) -> str:
    """Why two fingerprints of one input differ, in words."""
    where = "its content changed since the checkpoint was written" if old == new else \
        f"not the content the checkpoint read from {old}"
    if "sha256" in was:
        return (f"{where} (sha256 {was['sha256'][:12]}, {was['bytes']} bytes then; {will['sha256'][:12]}, "
                f"{will['bytes']} bytes now)")
    parts = [f"{was['bytes']} -> {will['bytes']} bytes" if was["bytes"] != will["bytes"] else "",
             "sampled blocks differ" if was["sampled_sha256"] != will["sampled_sha256"] else "",
             f"modified since ({_when(was['mtime_ns'])} then, {_when(will['mtime_ns'])} now)"
             if was["mtime_ns"] != will["mtime_ns"] else ""]
    return f"{where} ({'; '.join(p for p in parts if p)}; --streaming compares size, mtime and sampled blocks)"


def _when(ns: int) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))
