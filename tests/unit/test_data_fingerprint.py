"""The token stream's inputs by content (toolkit.data.fingerprint), as a resume compares them with its checkpoint
(toolkit.checkpoint.manifest.check_resumable): an edit in place is another input even at the same size, a move is
the same input, a streamed file is known by size, mtime and sampled blocks, and a manifest from before the
fingerprint resumes as it did, with a note. Real runs resumed on an edited and a moved file:
tests/distributed/test_resume_inputs.py."""

import json
import os

import pytest

from toolkit.checkpoint import manifest
from toolkit.data import fingerprint
from toolkit.errors import ConfigError
from toolkit.train.report import start_lines


def test_the_same_bytes_anywhere_are_one_input_and_an_edit_of_the_same_size_another(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "moved" / "b.txt"
    a.write_text("first document\n\nsecond document\n")
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    cache = str(tmp_path / "cache")
    assert fingerprint.of_input(a, cache) == fingerprint.of_input(b, cache) == {
        "sha256": fingerprint.of_input(a, cache)["sha256"], "bytes": 32}
    a.write_text("first document\n\nsecond documenT\n")  # same size
    assert fingerprint.of_input(a, cache) != fingerprint.of_input(b, cache)
    folder = tmp_path / "saved"  # a save_to_disk folder: its files by relative name
    (folder / "part").mkdir(parents=True)
    (folder / "part" / "data.arrow").write_bytes(b.read_bytes())
    copy = tmp_path / "copy"
    (copy / "part").mkdir(parents=True)
    (copy / "part" / "data.arrow").write_bytes(b.read_bytes())
    assert fingerprint.of_input(folder, cache) == fingerprint.of_input(copy, cache)


def test_a_files_hash_is_remembered_per_version_in_the_data_cache(tmp_path):
    data, cache = tmp_path / "a.txt", str(tmp_path / "cache")
    data.write_text("some text\n")
    first = fingerprint.of_input(data, cache)
    [kept] = (tmp_path / "cache" / "dstk").glob("sha256-*.json")
    assert json.loads(kept.read_text()) == first
    kept.write_text(json.dumps({"sha256": "from the record", "bytes": 10}))
    assert fingerprint.of_input(data, cache)["sha256"] == "from the record"  # read, not hashed again
    data.write_text("other text\n")  # a new version (size, mtime): hashed
    assert fingerprint.of_input(data, cache)["sha256"] not in (first["sha256"], "from the record")


def test_a_streamed_file_is_known_by_size_mtime_and_sampled_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 4)  # 16 blocks of 4 bytes
    data = tmp_path / "big.jsonl"
    data.write_bytes(bytes(range(256)) * 4)
    before = fingerprint.of_input(data, streaming=True)
    assert set(before) == {"bytes", "mtime_ns", "sampled_sha256"}
    os.utime(data, ns=(before["mtime_ns"], before["mtime_ns"] + 10**9))  # touched: the same bytes, a new mtime
    assert fingerprint.of_input(data, streaming=True) == {**before, "mtime_ns": before["mtime_ns"] + 10**9}
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1  # the first block, sampled
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(before["mtime_ns"], before["mtime_ns"]))
    assert fingerprint.of_input(data, streaming=True)["sampled_sha256"] != before["sampled_sha256"]


def record(path, content, **data) -> dict:
    return {"task": "causal-lm", "seq_len": 32, "data": {"path": str(path), "seed": 1, "eval_data": None,
                                                        "content": {"--data": content, "--eval-data": None}, **data}}


def saved_as(tmp_path, saved: dict):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "dstk").mkdir(parents=True, exist_ok=True)
    (ckpt / "dstk" / "manifest.json").write_text(json.dumps(saved))
    return ckpt


FULL = {"sha256": "a" * 64, "bytes": 100}


def test_a_resume_refuses_changed_content_naming_the_file_and_takes_moved_content_with_a_note(tmp_path):
    ckpt = saved_as(tmp_path, record("/data/train.txt", FULL))
    edited = record("/data/train.txt", {"sha256": "b" * 64, "bytes": 100})
    with pytest.raises(ConfigError) as refusal:
        manifest.check_resumable(ckpt, edited)
    said = str(refusal.value)
    assert ("--data /data/train.txt: its content changed since the checkpoint was written (sha256 aaaaaaaaaaaa, 100 "
            "bytes then; bbbbbbbbbbbb, 100 bytes now)") in said and "--resume-with-new-data" in said
    assert "data.path" not in said and "data.content" not in said  # said once, by content
    assert manifest.check_resumable(ckpt, edited, new_data=True) == []  # on purpose
    moved = record("/elsewhere/train.txt", FULL)
    assert manifest.check_resumable(ckpt, moved) == []
    notes = manifest.resume_notes(manifest.read_manifest(ckpt), moved)
    assert notes == ["--data /elsewhere/train.txt holds what the checkpoint read from /data/train.txt (same content): "
                     "resuming on it"]
    about = {"layout": {"dp": 1, "pp": 1, "tp": 1, "zero_stage": 0}, "model": "m", "model_name": "m", "from_dir": False,
             "seed": 1, "dtype": "fp32", "params": 10, "trainable": 10, "mbs": 1, "gas": 1, "gbs": 1, "seq_len": 32,
             "start_step": 2, "steps": 4, "resume": {"tag": "global_step2", "saved": {}, "notes": notes}}
    assert f"note: {notes[0]}" in start_lines(about)  # the opening block says it
    other = record("/elsewhere/train.txt", {"sha256": "c" * 64, "bytes": 7})
    with pytest.raises(ConfigError, match=r"--data /elsewhere/train.txt: not the content the checkpoint read from "
                                          r"/data/train.txt \(sha256 aaaaaaaaaaaa"):
        manifest.check_resumable(ckpt, other)


def test_a_streamed_file_touched_since_is_refused_and_one_moved_is_not(tmp_path):
    streamed = {"bytes": 100, "mtime_ns": 10**18, "sampled_sha256": "d" * 64}
    ckpt = saved_as(tmp_path, record("/data/big.jsonl", streamed, streaming=True))
    with pytest.raises(ConfigError, match=r"--data /data/big.jsonl: its content changed since the checkpoint was "
                                          r"written \(modified since \(.* then, .* now\); --streaming compares size, "
                                          r"mtime and sampled blocks\)"):
        manifest.check_resumable(ckpt, record("/data/big.jsonl", {**streamed, "mtime_ns": 2 * 10**18}, streaming=True))
    assert manifest.check_resumable(ckpt, record("/moved/big.jsonl", streamed, streaming=True)) == []
    # prepared now: another way of reading it, refused as the streaming setting (not as changed content)
    with pytest.raises(ConfigError, match=r"data\.streaming: checkpoint True, now None") as refusal:
        manifest.check_resumable(ckpt, record("/data/big.jsonl", FULL))
    assert "content changed" not in str(refusal.value)


def test_a_manifest_from_before_the_fingerprint_resumes_on_its_path_with_a_note(tmp_path):
    old = record("/data/train.txt", FULL)
    del old["data"]["content"]
    ckpt = saved_as(tmp_path, old)
    now = record("/data/train.txt", FULL)
    assert manifest.check_resumable(ckpt, now) == []
    assert manifest.resume_notes(old, now) == ["the checkpoint records no content fingerprint of --data (written by an "
                                               "older dstk): resumed on the same path, whose content could not be "
                                               "checked"]
    with pytest.raises(ConfigError, match=r"data\.path: checkpoint '/data/train.txt', now '/moved/train.txt'"):
        manifest.check_resumable(ckpt, record("/moved/train.txt", FULL))  # as before: by path


def test_a_tokenizer_folder_moved_with_the_same_files_is_the_same_tokenizer(tmp_path):
    saved = {**record("/d.txt", FULL, tokenizer_files="f" * 16), "tokenizer": "/tok"}
    ckpt = saved_as(tmp_path, saved)
    moved = {**saved, "tokenizer": "/moved/tok"}
    assert manifest.check_resumable(ckpt, moved) == []
    assert manifest.resume_notes(saved, moved) == ["--tokenizer /moved/tok holds what the checkpoint read from /tok "
                                                   "(same content): resuming on it"]
    with pytest.raises(ConfigError, match=r"tokenizer: checkpoint '/tok', now '/moved/tok'; data.tokenizer_files"):
        manifest.check_resumable(ckpt, {**moved, "data": {**moved["data"], "tokenizer_files": "e" * 16}})
