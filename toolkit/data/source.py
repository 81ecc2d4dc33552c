"""--data / --eval-data -> a HF `datasets.Dataset` (memory-mapped Arrow), local files only.

    *.txt *.text *.md      documents separated by blank lines (datasets "text", sample_by paragraph)
    *.jsonl *.json         one object per line, or a JSON array          (datasets "json"; a .jsonl file whose
                                                                         fields keep their types: pyarrow's
                                                                         reader, see read_jsonl)
    *.parquet *.csv *.arrow                                              (datasets "parquet"/"csv"/"arrow")
    a directory            written by Dataset.save_to_disk (a DatasetDict: its "train" split)

datasets builds its Arrow cache once (keyed by the file's path, size and mtime) and every later
load memory-maps it. Refusals name the file, the row and the fix (toolkit.errors).
"""

import codecs
import json
import os
import re
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
BUILDERS = {**{s: "text" for s in TEXT_SUFFIXES}, **{s: "json" for s in JSON_SUFFIXES},
            ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
CHUNK = 1 << 24  # bytes read at a time when checking a text file (16 MiB)
JSON_BLOCK = 1 << 22  # bytes of JSON lines pyarrow parses at a time, the next ones on its threads meanwhile (4 MiB: ~1.6x
# faster than 16 MiB on 50 MB, 2 cores); the first block fixes the types (a later change: datasets reads the file)
LONG_ROW_BLOCK = 1 << 26  # a file with a row longer than two JSON_BLOCKs (pyarrow: "straddling object") is read again
DATASETS_CHUNK = 10 << 20  # datasets' JSON loader: bytes per chunk, the first scanned for mixed objects
TRACE_COLUMNS = {"type", "system_prompt"}  # datasets' agent-trace detection needs one of these columns


def check_path(path, flag: str = "--data", encoding: str = "utf-8") -> Path:
    """The data file or save_to_disk folder, if dstk can read it; else a refusal saying why."""
    path = Path(path)
    if path.is_dir():
        if not _saved_dataset(path):
            raise UnusableInput(f"{flag} {path} is a directory but not one written by datasets' save_to_disk "
                                f"(no dataset_info.json or dataset_dict.json); pass a file ({', '.join(BUILDERS)})")
        return path
    if not path.is_file():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not path.suffix:
            raise UnusableInput(f"{flag} {path} does not exist locally and looks like a hub dataset name; the hub "
                                "is not reachable here: save it elsewhere with load_dataset(...).save_to_disk(DIR), "
                                f"copy DIR here and pass {flag} DIR")
        raise UnusableInput(f"data file {str(path)!r} does not exist; pass {flag} PATH to a local file "
                            f"({', '.join(BUILDERS)}) or a save_to_disk directory")
    if path.suffix.lower() not in BUILDERS:
        raise UnusableInput(f"{flag} {path}: unknown format {path.suffix or '(no extension)'!r}; dstk train reads "
                            f"{', '.join(BUILDERS)} files or a save_to_disk directory: rename or convert the file")
    if path.stat().st_size == 0:
        raise UnusableInput(f"data file {str(path)!r} is empty; it needs text or rows to train on")
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES or suffix in JSON_SUFFIXES or suffix == ".csv":
        check_text(path, encoding, limit=1 << 20, flag=flag)  # the first MiB now; the whole file when it is loaded
    if suffix == ".jsonl":
        check_first_row(path, flag, encoding)
    if suffix == ".parquet":
        check_magic(path, flag, b"PAR1", "Parquet")
    return path


def check_first_row(path: Path, flag: str, encoding: str) -> None:
    """A .jsonl file's first non-blank line is one JSON object (a row), else nothing after it is."""
    first_row(path, flag, encoding)


def first_row(path: Path, flag: str, encoding: str) -> dict:
    """A .jsonl file's first row (its first non-blank line, one JSON object), or a refusal saying what it is."""
    utf8 = encoding.lower().replace("-", "") == "utf8"
    with open(path, encoding="utf-8-sig" if utf8 else encoding, errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                break
        else:
            raise UnusableInput(f"{flag} {path} holds only blank lines; it needs one JSON object per line")
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise UnusableInput(f"{flag} {path} line {number} is not JSON ({exc.msg} at column {exc.colno}); a .jsonl "
                            "file holds one JSON object per line") from None
    if not isinstance(row, dict):
        raise UnusableInput(f"{flag} {path} line {number} is a JSON {type(row).__name__}, not an object; each line "
                            'of a .jsonl file is one row, e.g. {"text": "..."}')
    return row


def check_magic(path: Path, flag: str, magic: bytes, kind: str) -> None:
    with open(path, "rb") as fh:
        head = fh.read(len(magic))
    if head != magic:
        raise UnusableInput(f"{flag} {path} is not a {kind} file (it does not start with {magic!r}); convert it, or "
                            "rename it to what it holds")


def _saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def check_text(path: Path, encoding: str = "utf-8", limit: int | None = None, flag: str = "--data") -> None:
    """Read a text file in chunks, strictly: NUL bytes mean binary data, a byte that is not `encoding`
    is refused with its offset and line (training on replacement characters teaches garbage).
    limit: read only that many bytes (a quick look before any process starts)."""
    utf16 = encoding.lower().replace("-", "").startswith(("utf16", "utf32"))
    try:
        decoder = codecs.getincrementaldecoder("utf-8-sig" if encoding.lower() in ("utf-8", "utf8") else encoding)()
    except LookupError:
        raise UnusableInput(f"--encoding {encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, "
                            "cp1252, utf-16)") from None
    offset, lines, seen_text = 0, 0, False
    with open(path, "rb") as fh:
        while (limit is None or offset < limit) and (chunk := fh.read(CHUNK if limit is None else limit)):
            nul = chunk.find(b"\x00")
            if nul >= 0 and not utf16:
                raise UnusableInput(f"{flag} {path}: binary data (a NUL byte at offset {offset + nul}), not text; "
                                    "pass a text file")
            try:
                seen_text |= bool(decoder.decode(chunk).strip())
            except UnicodeDecodeError as exc:
                raise _not_encoded(path, encoding, chunk, exc.start, offset, lines) from None
            offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
        try:
            seen_text |= bool(decoder.decode(b"", final=limit is None or offset < limit).strip())
        except UnicodeDecodeError:  # the file ends inside a character
            raise _not_encoded(path, encoding, b"?", 0, offset, lines) from None
    if not seen_text and (limit is None or offset < limit):
        raise UnusableInput(f"data file {str(path)!r} is empty; it needs text or rows to train on")


def _not_encoded(path, encoding, chunk: bytes, start: int, offset: int, lines: int) -> UnusableInput:
    line = lines + chunk.count(b"\n", 0, start) + 1
    return UnusableInput(f"--data {path} is not {encoding} text: byte 0x{chunk[start]:02x} at offset "
                         f"{offset + start} (line {line}); pass --encoding with the file's encoding (e.g. "
                         f"--encoding latin-1), or convert it: iconv -f LATIN1 -t UTF-8 {path} > "
                         f"{path.stem}.utf8{path.suffix}")


def decode_text(raw: bytes, path: Path, encoding: str = "utf-8") -> str:
    """The text of `raw` (bytes already in memory), with check_text's refusals."""
    nul = raw.find(b"\x00")
    if nul >= 0 and not encoding.lower().replace("-", "").startswith(("utf16", "utf32")):
        raise UnusableInput(f"--data {path}: binary data (a NUL byte at offset {nul}), not text; pass a text file")
    try:
        return raw.decode("utf-8-sig" if encoding.lower() in ("utf-8", "utf8") else encoding)
    except LookupError:
        raise UnusableInput(f"--encoding {encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, "
                            "cp1252, utf-16)") from None
    except UnicodeDecodeError as exc:
        raise _not_encoded(path, encoding, raw, exc.start, 0, 0) from None


def load(path, encoding: str = "utf-8", cache_dir: str | None = None, flag: str = "--data"):
    """The rows of a checked path as a datasets.Dataset, in file order."""
    import datasets

    path = check_path(path, flag, encoding)
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded and len(loaded) != 1:
                raise UnusableInput(f"{flag} {path} holds splits {sorted(loaded)} and none is 'train'; save the "
                                    "split to train on with Dataset.save_to_disk")
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        return loaded
    builder = BUILDERS[path.suffix.lower()]
    if path.suffix.lower() == ".jsonl" and (ds := read_jsonl(path, cache_dir)) is not None:
        return ds
    kwargs = {}
    if builder == "text":
        check_once(path, encoding, cache_dir)
        kwargs = {"sample_by": "paragraph", "encoding": encoding}
    elif builder == "csv":
        kwargs = {"encoding": encoding}
    try:
        ds = datasets.load_dataset(builder, data_files=str(path.resolve()), split="train", cache_dir=cache_dir,
                                   **kwargs)
    except Exception as exc:  # noqa: BLE001  pyarrow's message names neither the row nor the fix: find them
        if builder == "json":
            diagnose_jsonl(path)
        raise UnusableInput(f"{flag} {path}: datasets could not read it as {builder} "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    if len(ds) == 0:
        raise UnusableInput(f"data file {str(path)!r} is empty; it needs text or rows to train on")
    return ds


def read_jsonl(path: Path, cache_dir: str | None):
    """A .jsonl file as a memory-mapped datasets.Dataset, read by pyarrow's streaming JSON reader (C++, its
    threads, one block in memory at a time) into an Arrow file under the cache folder, once per version of the
    file (path, size, mtime): ~4x faster than load_dataset("json"). None (datasets' loader reads it) wherever
    datasets would read the rows otherwise: a field that appears or changes type along the file, objects whose
    keys differ inside a column (datasets' Json feature), columns its agent-trace parser claims."""
    import datasets
    import pyarrow as pa
    from datasets.table import MemoryMappedTable

    key = file_key(path, "jsonl", pa.__version__, datasets.__version__)
    target = cache_root(cache_dir) / f"jsonl-{key}.arrow"
    if (declined := target.with_suffix(".datasets")).exists():
        return None
    if not target.exists():
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            try:
                holes = _json_to_arrow(path, partial, JSON_BLOCK)
            except pa.ArrowInvalid as exc:
                if "straddl" not in str(exc):  # else a row longer than two blocks: again, in blocks that hold it
                    raise
                holes = _json_to_arrow(path, partial, LONG_ROW_BLOCK)
            if holes and mixed_objects(path):
                raise pa.ArrowInvalid("objects whose keys differ: datasets makes them Json")
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            partial.unlink(missing_ok=True)
            declined.touch()
            return None
        except BaseException:  # stopped (Ctrl-C, launch.sh's SIGTERM: toolkit.train.runner), a full disk, ...
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, target)  # whole or absent: no rank maps a file being written
    table = MemoryMappedTable.from_file(str(target))
    if table.num_rows == 0:
        raise UnusableInput(f"data file {str(path)!r} is empty; it needs text or rows to train on")
    return datasets.Dataset(table, fingerprint=key)


def _json_to_arrow(path: Path, partial: Path, block: int) -> bool:
    """JSON lines -> an Arrow stream file, `block` bytes parsed at a time; is there a null or an empty object inside a
    nested column (_holes)? Raises pyarrow's error where it cannot read the file as one table."""
    import pyarrow as pa
    import pyarrow.json as pj

    reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=block))
    if TRACE_COLUMNS & set(reader.schema.names):
        raise pa.ArrowInvalid("datasets' agent-trace parser may claim these rows")
    holes = False
    with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_stream(sink, reader.schema) as writer:
        for batch in reader:
            writer.write_batch(batch)
            holes = holes or any(map(_holes, batch.columns))
    return holes


def _holes(array) -> bool:
    """Is there a null or an empty object inside a nested column (an object's missing key reads as null)? Where
    there is none, every object at each place had the same keys, and datasets' scan finds nothing."""
    import pyarrow as pa

    kind = array.type
    if pa.types.is_struct(kind):
        return kind.num_fields == 0 or any(child.null_count or _holes(child) for child in array.flatten())
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _nested(kind.value_type):
        values = array.flatten()
        return values.null_count > 0 or _holes(values)
    return False


def mixed_objects(path: Path) -> bool:
    """datasets' own scan of its loader's first chunk for objects whose keys differ (it makes those fields Json)."""
    import pyarrow as pa
    from datasets.utils.json import find_mixed_struct_types_field_paths, ujson_loads

    with open(path, "rb") as fh:
        head = fh.read(DATASETS_CHUNK) + fh.readline()
    try:
        return bool(find_mixed_struct_types_field_paths([ujson_loads(line) for line in head.splitlines()]))
    except ValueError:
        raise pa.ArrowInvalid("not JSON lines") from None


def _nested(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_struct(kind) or (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _nested(
        kind.value_type)


def file_key(path: Path, *extra) -> str:
    """A key for one version of a file: its absolute path, size and modification time (what datasets' loaders
    key their caches by), and `extra`."""
    import hashlib

    stat = path.stat()
    body = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, *extra])
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def cache_root(cache_dir: str | None) -> Path:
    """dstk's folder in the data cache (--data-cache, else HF_DATASETS_CACHE), created."""
    import datasets

    root = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "dstk"
    root.mkdir(parents=True, exist_ok=True)
    return root


def check_once(path: Path, encoding: str, cache_dir: str | None) -> None:
    """check_text on the whole file, once per version of it (path, size, mtime, encoding): a marker in the cache
    folder spares the ranks that wait for the preparing one, and every warm start, another full read."""
    marker = cache_root(cache_dir) / f"checked-{file_key(path, encoding)}"
    if marker.exists():
        return
    check_text(path, encoding)
    marker.touch()


def diagnose_jsonl(path: Path) -> None:
    """Why pyarrow refused a JSON-lines file: the first broken line, non-object, or a field whose type
    changes between rows (raises), else returns (the caller reports pyarrow's message)."""
    first: dict = {}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if lineno == 1 and line.lstrip().startswith("["):
                    return  # a JSON array file: not line-oriented
                raise UnusableInput(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one object") \
                    from None
            if not isinstance(record, dict):
                raise UnusableInput(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            for key, value in record.items():
                kind = type(value)
                if value is not None and first.setdefault(key, kind) is not kind:
                    raise ConfigError(f"{path}: JSONL row {lineno}: {key!r} is {kind.__name__} "
                                      f"{json.dumps(value)[:40]}, not {_a(first[key])}; fix the row")


def _a(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object",
            bool: "a boolean"}.get(kind, kind.__name__)


def seq_len_fits(seq_len: int, max_positions: int | None) -> None:
    """--seq-len within the model's positions (max_position_embeddings, n_positions; None: it does not say)."""
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's {max_positions} positions "
                          f"(max_position_embeddings); use --seq-len {max_positions} or less")
