"""A .jsonl file read by pyarrow's streaming reader (toolkit.data.source.read_jsonl) gives the dataset datasets'
own JSON loader gives, rows and features, or is left to that loader wherever the two would differ; it is read
once per version of the file, and never leaves a half-written Arrow file."""

import json

import pyarrow.json as pj
import pytest

from toolkit.data import source

ROWS = {
    "text": [{"text": f"document {n} " * (n % 7 + 1)} for n in range(300)],
    "prompt-completion": [{"prompt": f"q{n}", "completion": f"a{n}", "score": n / 3} for n in range(300)],
    "chat": [{"messages": [{"role": "user", "content": f"hi {n}"}, {"role": "assistant", "content": "yo " * n}]}
             for n in range(300)],
    "nulls": [{"text": f"t{n}", "extra": None if n % 2 else n} for n in range(300)],
}
DATASETS_WAY = {  # rows whose dataset datasets builds its own way: left to its loader
    "a field that appears late": [{"text": "a" * 50}] * 3000 + [{"text": "b", "extra": 1}],
    "a type that changes": [{"text": "a" * 50}] * 3000 + [{"text": 5}],
    "objects whose keys differ": [{"messages": [{"role": "user", "content": "x"}]},
                                  {"messages": [{"role": "user", "content": "y", "name": "z"}]}],
    "an agent-trace column": [{"type": "user", "text": "hello"}] * 3,
}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def by_datasets(path, cache):
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache))


@pytest.mark.parametrize("kind", list(ROWS) + list(DATASETS_WAY))
def test_the_rows_and_features_are_datasets_own(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(source, "JSON_BLOCK", 1 << 16)  # "late": after pyarrow's first block (4 MiB otherwise)
    path = write(tmp_path / "data.jsonl", ROWS.get(kind) or DATASETS_WAY[kind])
    got, want = source.load(path, cache_dir=str(tmp_path / "cache")), by_datasets(path, tmp_path / "hf")
    assert got.features == want.features
    assert got.to_list() == want.to_list()
    fast = any((tmp_path / "cache" / "dstk").glob("jsonl-*.arrow"))
    assert fast == (kind in ROWS), "pyarrow's reader took rows datasets reads its own way, or declined plain rows"


def test_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    path, cache = write(tmp_path / "data.jsonl", ROWS["text"]), str(tmp_path / "cache")
    first = source.load(path, cache_dir=cache)
    with monkeypatch.context() as m:
        m.setattr(pj, "open_json", lambda *a, **k: pytest.fail("parsed again"))
        again = source.load(path, cache_dir=cache)
    assert again._fingerprint == first._fingerprint and again.to_list() == first.to_list()
    write(path, ROWS["text"] + [{"text": "a new document"}])
    changed = source.load(path, cache_dir=cache)
    assert len(changed) == len(first) + 1 and changed[-1]["text"] == "a new document"
    assert changed._fingerprint != first._fingerprint


def test_a_failed_read_leaves_no_arrow_file_and_datasets_names_the_row(tmp_path):
    rows = "".join(json.dumps({"text": "a" * 50}) + "\n" for _ in range(3000)) + '{"text": "broken\n'
    path = tmp_path / "data.jsonl"
    path.write_text(rows)
    with pytest.raises(Exception, match="3001"):
        source.load(path, cache_dir=str(tmp_path / "cache"))
    assert not list((tmp_path / "cache" / "dstk").glob("*.arrow*"))


def test_datasets_scan_runs_only_where_an_object_may_lack_a_key(tmp_path, monkeypatch):
    """Objects with every key everywhere need no scan; a null inside one (an explicit null, or a missing key)
    gets datasets' scan, which decides: explicit nulls keep pyarrow's rows, missing keys go datasets' way."""
    scans = []
    real = source.mixed_objects
    monkeypatch.setattr(source, "mixed_objects", lambda path: scans.append(path.name) or real(path))
    full = [{"messages": [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": "a"}]}
            for n in range(50)]
    explicit = full + [{"messages": [{"role": "user", "content": None}]}]
    missing = full + [{"messages": [{"role": "user"}]}]
    for name, rows in (("full", full), ("explicit", explicit), ("missing", missing)):
        path = write(tmp_path / f"{name}.jsonl", rows)
        got, want = source.load(path, cache_dir=str(tmp_path / "cache")), by_datasets(path, tmp_path / "hf")
        assert got.features == want.features and got.to_list() == want.to_list(), name
    assert scans == ["explicit.jsonl", "missing.jsonl"]
    assert {p.name.split("-")[0] for p in (tmp_path / "cache" / "dstk").glob("jsonl-*.arrow")} == {"jsonl"}
    assert len(list((tmp_path / "cache" / "dstk").glob("jsonl-*.arrow"))) == 2  # full and explicit


def test_a_row_longer_than_two_blocks_is_read_again_in_blocks_that_hold_it(tmp_path, monkeypatch):
    """pyarrow refuses a row that straddles two block boundaries; the file is parsed again in larger blocks (not
    left to datasets' slower loader), with datasets' rows."""
    monkeypatch.setattr(source, "JSON_BLOCK", 1 << 12)
    monkeypatch.setattr(source, "LONG_ROW_BLOCK", 1 << 16)
    rows = [{"text": f"short {n}"} for n in range(20)] + [{"text": "long " * 2000}] + [{"text": "end"}]
    path = write(tmp_path / "data.jsonl", rows)
    with pytest.raises(Exception, match="straddl"):  # what the first pass meets
        list(pj.open_json(path, read_options=pj.ReadOptions(block_size=1 << 12)))
    got = source.load(path, cache_dir=str(tmp_path / "cache"))
    assert any((tmp_path / "cache" / "dstk").glob("jsonl-*.arrow")) and not any(
        (tmp_path / "cache" / "dstk").glob("*.datasets"))
    assert got.to_list() == by_datasets(path, tmp_path / "hf").to_list() == rows
