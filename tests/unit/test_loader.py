"""Reading config files: what DeepSpeed reads passes (hjson with a warning), the rest is refused in one line."""

import json

import pytest

from toolkit.config.loader import MAX_BYTES, parse_config_text, read_config
from toolkit.config.problems import ERROR, WARNING
from toolkit.errors import UnusableInput


def _write(tmp_path, content, name="ds.json"):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def test_strict_json_reads_clean(tmp_path):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
    assert read_config(_write(tmp_path, json.dumps(cfg))) == (cfg, [])


def test_utf8_bom_is_accepted(tmp_path):
    cfg, problems = read_config(_write(tmp_path, b'\xef\xbb\xbf{"train_batch_size": 8}'))
    assert cfg == {"train_batch_size": 8} and problems == []


def test_hjson_comments_and_trailing_commas_pass_with_a_warning(tmp_path):
    text = '{\n  // global batch\n  "train_batch_size": 8,\n  "bf16": {"enabled": true,},\n}\n'
    cfg, problems = read_config(_write(tmp_path, text))
    assert cfg == {"train_batch_size": 8, "bf16": {"enabled": True}}
    assert [p.severity for p in problems] == [WARNING]
    assert "not strict JSON" in problems[0].message and "line 2" in problems[0].message


def test_duplicate_keys_are_errors_with_their_path():
    cfg, problems = parse_config_text('{"zero_optimization": {"stage": 1, "stage": 3}, "bf16": {}}')
    assert cfg["zero_optimization"]["stage"] == 3
    assert [(p.path, p.severity) for p in problems] == [("$.zero_optimization.stage", ERROR)]
    assert 'duplicate key "stage"' in problems[0].message


@pytest.mark.parametrize("content, reason", [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary"),
    (b'{"job_name": "caf\xe9"}', "not UTF-8"),
    ('{"train_batch_size": 8,\n "bf16": {"enabled": }}', "broken JSON at line 2 column 22"),
    ("[1, 2, 3]", "top level is a list"),
    ('"train_batch_size"', "top level is a string"),
    ("", "empty"),
    ('{"gradient_clipping": NaN}', "NaN"),
    ('{"gradient_clipping": Infinity}', "Infinity"),
    ('{"gradient_clipping": 1e999}', "$.gradient_clipping is inf"),
    ('{"train_batch_size": 18446744073709551616}', "beyond a 64-bit integer"),
    ('{"a": ' * 150 + "1" + "}" * 150, "nested deeper than 100"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_unusable_input_gets_one_clear_line(tmp_path, content, reason):
    path = _write(tmp_path, content)
    with pytest.raises(UnusableInput) as info:
        read_config(path)
    message = str(info.value)
    assert reason in message and str(path) in message
    assert "\n" not in message and len(message) < 300


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(UnusableInput, match="no such file"):
        read_config(tmp_path / "nope.json")
    with pytest.raises(UnusableInput, match="is a directory"):
        read_config(tmp_path)


def test_huge_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as fh:
        fh.truncate(MAX_BYTES + 1)  # sparse: costs no disk or time
    with pytest.raises(UnusableInput, match="too big"):
        read_config(path)


def test_unreadable_file(tmp_path):
    import os

    path = _write(tmp_path, "{}")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything
        pytest.skip("running as root: permissions are not enforced")
    with pytest.raises(UnusableInput, match="cannot read"):
        read_config(path)


def test_parse_config_text_names_its_source():
    with pytest.raises(UnusableInput, match="^preset.json: "):
        parse_config_text("[]", source="preset.json")
