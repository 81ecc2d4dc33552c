"""`dstk train` refuses bad input the way `dstk validate` does: one message naming the flag or key,
a non-zero exit, no traceback, printed once, nothing written; and runs never mix in one --out.

Refusals that come before any process group are checked through the real entry point (what
`python -m toolkit.train`, started by every launcher, runs: toolkit.cli.main(["train", ...])) in this
process, without the launcher variables of its world of one; runs that train go through
toolkit.train.runner.run in this process's world of one (tests/conftest.py ds_world1). launch.sh's own
refusals: tests/commands/test_launch_sh.py.
"""

import json
from pathlib import Path

import pytest

from tests.configs import ds_config, write_config
from tests.conftest import DIST_ENV
from tests.invoke import invoke_dstk
from toolkit.errors import ConfigError, UnusableInput

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"
GOOD_CONFIG = ds_config(2, 2, gradient_clipping=0.0)


def train_config(tmp_path, cfg=None) -> Path:
    return write_config(tmp_path / "ds.json", GOOD_CONFIG if cfg is None else cfg)


def train_entry(args, env=None):
    """`python -m toolkit.train ARGS` as a process started by hand runs it (toolkit.cli.main(["train", *ARGS]),
    none of the launcher variables this process's world of one set, `env` on top, from the repository),
    in this process."""
    return invoke_dstk(["train", *args], cwd=REPO, env={**{k: None for k in DIST_ENV}, **(env or {})})


def train_cli(tmp_path, *args, env=None, data=CORPUS, config=None):
    """`python -m toolkit.train ARGS` started by hand (a world of one), run in this process."""
    return train_entry(["--model", "tiny-gpt2", "--data", str(data), "--config", str(config or train_config(tmp_path)),
                        "--out", str(tmp_path / "run"), "--seq-len", "32", *args], env=env)


def refused(result, code: int, *fragments):
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-2000:]
    heads = [line for line in result.stderr.splitlines() if line.lower().startswith("error:")]
    assert len(heads) == 1, result.stderr  # one message (a config's problems follow it, indented)


@pytest.mark.parametrize("args, flag", [
    (["--seq-len", "0"], "--seq-len"), (["--seq-len", "-8"], "--seq-len"),
    (["--steps", "0"], "--steps"), (["--steps", "-3"], "--steps"), (["--eval-fraction", "1"], "--eval-fraction"),
    (["--eval-fraction", "-0.1"], "--eval-fraction"), (["--save-every", "-1"], "--save-every"),
])
def test_out_of_range_arguments_are_usage_errors(tmp_path, args, flag):
    result = train_cli(tmp_path, *args)
    refused(result, 2, flag)
    assert not (tmp_path / "run").exists()


def test_only_rank_zero_prints_a_refusal_every_rank_reaches(tmp_path):
    result = train_cli(tmp_path, "--steps", "0", env={"RANK": "1", "WORLD_SIZE": "2"})
    assert result.returncode == 2 and result.stderr == ""


# Rows refused while the data is read, after `dstk train` started its process group (and tears it down):
# tests/commands/test_process_group.py, in processes of their own.
@pytest.mark.parametrize("make, code, fragments", [
    (lambda d: d, 2, ["--data", "is a directory"]),
    (lambda d: write_rows(d / "rows.xml", b"<text>hello</text>\n"), 2, ["--data", "unknown format '.xml'", ".jsonl",
                                                                    ".parquet"]),
    (lambda d: write_rows(d / "bin.txt", b"abc\x00\x01\x02"), 2, ["binary data (a NUL byte at offset 3)"]),
    (lambda d: write_rows(d / "l1.txt", "caf\u00e9 au lait\n".encode("latin-1")), 2,
     ["is not utf-8 text: byte 0xe9 at offset 3 (line 1)", "--encoding latin-1", "iconv"]),
    (lambda d: Path("someorg/some_dataset"), 2, ["looks like a hub dataset name", "save_to_disk"]),
])
def test_unusable_data_is_refused_naming_the_file_and_the_way_out(tmp_path, make, code, fragments):
    check_unusable_data(train_cli, tmp_path, make, code, fragments)


def check_unusable_data(train, tmp_path, make, code, fragments):
    """`train` (in this process or a fresh one) on the data `make` writes: refused with `code` and the
    fragments, once, with no checkpoint written."""
    (tmp_path / "d").mkdir()
    data = make(tmp_path / "d")
    result = train(tmp_path, "--steps", "1", data=data)
    refused(result, code, *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def write_rows(path: Path, raw: bytes) -> Path:
    path.write_bytes(raw)
    return path


def test_an_encoding_flag_reads_the_same_file():
    from toolkit.data import decode_text

    raw = "caf\u00e9\n".encode("latin-1")
    assert decode_text(raw, Path("x.txt"), "latin-1") == "caf\u00e9\n"
    with pytest.raises(UnusableInput, match="--encoding 'klingon' is not an encoding"):
        decode_text(raw, Path("x.txt"), "klingon")


@pytest.mark.parametrize("text, code, fragment", [
    ('{"train_batch_size": 8,', 2, "broken JSON at line 1"),
    ("[1, 2]", 2, "the top level is a list"),
    (None, 2, "is a directory, not a config file"),
])
def test_unreadable_config_is_refused_before_the_process_group(tmp_path, text, code, fragment):
    config = tmp_path / "cfgdir"
    if text is None:
        config.mkdir()
    else:
        config.write_text(text)
    refused(train_cli(tmp_path, config=config), code, fragment)


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("not a folder")
    refused(train_cli(tmp_path), 1, "--out", "is a file")
    assert (tmp_path / "run").read_text() == "not a folder"


def _args(tmp_path, **kw):
    from toolkit.train.runner import TrainArgs

    kw.setdefault("config", str(train_config(tmp_path)))
    return TrainArgs(**{**dict(model="tiny-gpt2", data=str(CORPUS),
                               out=str(tmp_path / "run"), seq_len=32, steps=2, progress=False,
                               data_cache=str(tmp_path / "cache"),
                               export=False), **kw})


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_runs_never_mix_in_one_out(ds_world1, tmp_path):
    from toolkit.train.runner import run

    run(_args(tmp_path))
    before = _snapshot(tmp_path / "run")
    assert "checkpoints/latest" in before and "loss.png" in before
    with pytest.raises(ConfigError, match=r"--out .*run already holds files \(checkpoints, loss.png, metrics.jsonl, summary.json\); "
                                          "pass --resume to continue that run, --overwrite"):
        run(_args(tmp_path, steps=3))
    assert _snapshot(tmp_path / "run") == before  # byte for byte
    with pytest.raises(ConfigError, match="--resume and --overwrite contradict"):
        run(_args(tmp_path, resume=True, overwrite=True))
    with pytest.raises(ConfigError, match=r"--resume: .* was written by another run \(seq_len: checkpoint 32, now 16\)"):
        run(_args(tmp_path, resume=True, steps=4, seq_len=16))
    zero1 = tmp_path / "zero1.json"
    zero1.write_text(json.dumps({**GOOD_CONFIG, "zero_optimization": {"stage": 1}}))
    # (the ZeRO stage may change on resume since toolkit.checkpoint.portable: checkpoint.LAYOUT_KEYS)
    with pytest.raises(ConfigError, match=r"another run \(model: checkpoint '[^']*', now 'tiny-llama'"):
        run(_args(tmp_path, resume=True, steps=4, model="tiny-llama", config=str(zero1)))
    assert _snapshot(tmp_path / "run") == before
    run(_args(tmp_path, overwrite=True, steps=3))  # a fresh run: the old tags are gone
    tags = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("global_step*"))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert tags == ["global_step3"] and [json.loads(x).get("step") for x in lines] == [1, 2, 3, None]


def test_resume_into_a_folder_without_a_checkpoint_says_so(ds_world1, tmp_path):
    from toolkit.train.runner import run

    with pytest.raises(ConfigError, match=r"--resume: .*run holds no checkpoint to resume .*drop --resume"):
        run(_args(tmp_path, resume=True))
    assert not (tmp_path / "run").exists()


def test_no_eval_split_writes_null_not_nan(ds_world1, tmp_path):
    from toolkit.train.runner import run

    summary = run(_args(tmp_path, eval_fraction=0.0, eval_every=1, steps=2))
    assert summary["eval_loss"] is None

    def no_constant(name):
        raise AssertionError(f"{name} in metrics.jsonl is not JSON")

    records = [json.loads(line, parse_constant=no_constant)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["summary"]["eval_loss"] is None and all("eval_loss" not in r for r in records[:-1])


def test_latest_is_replaced_atomically_and_leaves_no_temporary(tmp_path):
    from toolkit.checkpoint.manifest import read_latest, write_latest

    write_latest(tmp_path, "global_step4")
    write_latest(tmp_path, "global_step8")
    assert read_latest(tmp_path) == "global_step8" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_eval_batches_is_accepted_with_a_note_and_a_bad_chat_template_is_refused(tmp_path):
    ok = train_cli(tmp_path, "--eval-batches", "2", "--check")
    assert ok.returncode == 0 and "note: --eval-batches is ignored" in ok.stderr, ok.stderr[-2000:]
    refused(train_cli(tmp_path, "--chat-template", str(tmp_path / "none.jinja"), "--check"), 1,
            "--chat-template", "cannot read it")


def test_flash_attention_with_an_fp32_config_is_refused_before_anything_is_built(tmp_path):
    """flash-attn takes fp16/bf16 only (its first forward would fail on every rank); said before any check
    that needs CUDA, so a login node without GPUs says it too."""
    refused(train_cli(tmp_path, "--attention", "flash_attention_2", "--check"), 1,
            "--attention flash_attention_2 with an fp32 config", '"bf16": {"enabled": true}')
    assert not (tmp_path / "run").exists()


def test_a_chat_template_with_a_jinja_syntax_error_is_refused_naming_file_and_line(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    refused(train_cli(tmp_path, "--chat-template", str(broken), "--check"), 1,
            f"--chat-template {broken}: line 2:", "Jinja syntax error")


def test_a_chat_template_that_raises_on_a_row_is_named_with_the_row(tmp_path):
    from toolkit.data.chat import render_chat
    from toolkit.errors import UnusableInput
    from toolkit.train import hf

    tok = hf.byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}" \
                        "{{ raise_exception('no assistants here') }}{% endif %}{% endfor %}"
    with pytest.raises(UnusableInput, match=r"chat.jsonl row 7: the chat template failed.*no assistants here"):
        render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok, "chat.jsonl", 7)


@pytest.mark.parametrize("where, words", [
    ("under-a-file", "is a file, so nothing can be made under it; choose another --out"),
    ("/sys/dstk-run", "cannot write in /sys (Permission denied)"),  # read-only for root too
])
def test_an_out_that_cannot_be_written_is_refused_by_check_and_before_any_model_is_built(tmp_path, monkeypatch,
                                                                                       where, words):
    from toolkit.train import hf

    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run" if where == "under-a-file" else where
    for extra in (["--check"], []):  # the run itself refuses before its first model or tokenizer build
        monkeypatch.setattr(hf, "load_tokenizer", lambda *_, **__: pytest.fail("built before refusing"))
        refused(train_cli(tmp_path, "--out", str(out), *extra), 1, f"--out {out}", words)


@pytest.mark.parametrize("content, words", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary data (a NUL byte at offset"),
    (b"id,text\n1,hello\n", "line 1 is not JSON"),
    (b'\n\n["a", "b"]\n', "line 3 is a JSON list, not an object"),
])
def test_check_refuses_a_jsonl_file_that_is_no_json_lines(tmp_path, content, words):
    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    refused(train_cli(tmp_path, "--check", data=data), 2, f"--data {data}", words)


def test_check_refuses_pipeline_parts_recorded_for_another_model(tmp_path):
    """`dstk partition tiny-gpt2 --pp 2 --config ds.json` records tiny-gpt2's 7-layer split; training gpt2
    (15 pipeline layers) with that file is refused by --check, naming the command that records its own."""
    from tests.invoke import invoke_dstk

    config = train_config(tmp_path, {**GOOD_CONFIG, "pipeline": {"stages": 2}})
    recorded = invoke_dstk(["partition", "tiny-gpt2", "--pp", "2", "--config", str(config)])
    assert recorded.returncode == 0, recorded.stderr
    refused(train_entry(["--model", "gpt2", "--data", str(CORPUS), "--config", str(config), "--out",
                         str(tmp_path / "run"), "--check"]), 1,
            "does not fit --model gpt2, which has 15 pipeline layers", "recorded for another model",
            f"dstk partition gpt2 --pp 2 --config {config}")
    ok = train_entry(["--model", "tiny-gpt2", "--data", str(CORPUS), "--config", str(config), "--out",
                      str(tmp_path / "run"), "--seq-len", "32", "--check"])
    assert ok.returncode == 0, ok.stderr


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    from toolkit.train import hf

    folder = tmp_path_factory.mktemp("llama")
    hf.builtin_model("tiny-llama").save_pretrained(folder)
    hf.byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage, words", [
    ("garbage", "model.safetensors is not a safetensors file"),
    ("truncated", "model.safetensors is cut short"),
    ("config", "config.json is not JSON (Expecting property name"),
])
def test_a_damaged_model_directory_is_refused_naming_the_file(tmp_path, saved_llama, damage, words):
    """Read from the files' headers by --check and by every rank before it builds anything."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved_llama, folder)
    weights = folder / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(bytes(range(256)) * 20)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
    else:
        (folder / "config.json").write_text("{not json")
    for extra in (["--check"], []):
        refused(train_entry(["--model", str(folder), "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
                             "--out", str(tmp_path / "run"), "--seq-len", "32", *extra]), 2, words)


def test_a_model_directory_without_a_tokenizer_is_refused_at_once_saying_where_dstk_looked(tmp_path, saved_llama):
    import shutil
    import time

    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(saved_llama / name, folder / name)
    start = time.monotonic()
    refused(train_entry(["--model", str(folder), "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
                         "--out", str(tmp_path / "run"), "--check"]), 1,
            f"no tokenizer found: --model {folder} holds none of tokenizer.json", "pass --tokenizer DIR")
    assert time.monotonic() - start < 30  # no hub retries
    refused(train_entry(["--model", str(folder), "--tokenizer", "org/tok", "--data", str(CORPUS), "--config",
                         str(train_config(tmp_path)), "--out", str(tmp_path / "run"), "--check"]), 2,
            "--tokenizer org/tok: no such local directory, and the hub id is not in the Hugging Face cache",
            "hf download org/tok")  # offline (tests/conftest.py): at once; tests/unit/test_hub.py
    ok = train_entry(["--model", str(folder), "--tokenizer", str(saved_llama), "--data", str(CORPUS), "--config",
                      str(train_config(tmp_path)), "--out", str(tmp_path / "run"), "--seq-len", "32", "--check"])
    assert ok.returncode == 0, ok.stderr


def test_overwrite_never_deletes_what_the_run_reads_nor_a_folder_above_it(tmp_path, saved_llama):
    """--overwrite deletes what --out holds: refused (nothing touched) when --model or --data is inside it,
    or --out is the current folder (train_entry runs in the repository) or the root."""
    import shutil

    out = tmp_path / "runs"
    shutil.copytree(saved_llama, out / "model")
    data = out / "data.txt"
    data.write_text((CORPUS.read_text()))
    refused(train_entry(["--model", str(out / "model"), "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
                         "--out", str(out), "--overwrite", "--check"]), 1,
            f"--out {out} --overwrite would delete --model {out / 'model'}, which is inside it")
    refused(train_entry(["--model", "tiny-gpt2", "--data", str(data), "--config", str(train_config(tmp_path)),
                         "--out", str(out), "--overwrite", "--check"]), 1, f"would delete --data {data}")
    for where in (".", "/"):
        refused(train_entry(["--model", "tiny-gpt2", "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
                             "--out", where, "--overwrite", "--check"]), 1, "--overwrite would delete everything in")
    assert (out / "model" / "config.json").is_file() and data.is_file()


def test_resume_refuses_an_empty_latest_or_one_naming_no_tag(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "global_step2").mkdir(parents=True)
    (ckpt / "latest").write_text("")
    refused(train_cli(tmp_path, "--resume", "--check"), 1, f"--resume: {ckpt / 'latest'} is empty; write one of "
            "global_step2 into it")
    (ckpt / "latest").write_text("global_step99")
    refused(train_cli(tmp_path, "--resume", "--check"), 1, "names 'global_step99', which is not a folder there")


@pytest.mark.parametrize("damage, words", [
    ("list", "config.json is not a HF model config"),
    ("no-weights", "holds no weights (none of model.safetensors"),
])
def test_a_model_directory_without_a_config_object_or_weights_is_refused(tmp_path, saved_llama, damage, words):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved_llama, folder)
    if damage == "list":
        (folder / "config.json").write_text("[1, 2]")
    else:
        (folder / "model.safetensors").unlink()
    refused(train_entry(["--model", str(folder), "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
                         "--out", str(tmp_path / "run"), "--check"]), 2, words)


def test_an_out_that_is_a_link_to_nowhere_is_refused(tmp_path):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    refused(train_cli(tmp_path, "--out", str(link), "--check"), 1, f"--out {link} is a link to")


def test_a_damaged_tokenizer_file_is_refused_by_check(tmp_path, saved_llama):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved_llama, folder)
    json_files = [p.name for p in folder.glob("tokenizer*.json")]
    assert json_files
    (folder / json_files[0]).write_text("{garbage")
    refused(train_entry(["--model", str(folder), "--data", str(CORPUS), "--config", str(train_config(tmp_path)),
                         "--out", str(tmp_path / "run"), "--check"]), 1, f"--model {folder}: {json_files[0]} is not JSON")


def test_a_chat_template_raising_a_python_error_on_a_row_is_named_with_the_row():
    from toolkit.data.chat import render_chat
    from toolkit.errors import UnusableInput
    from toolkit.train import hf

    tok = hf.byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ 1 / 0 }}{% endfor %}"
    with pytest.raises(UnusableInput, match=r"chat.jsonl row 3: the chat template failed: ZeroDivisionError"):
        render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok, "chat.jsonl", 3)


@pytest.mark.parametrize("args, fragments", [
    (["--steps", "4"], ["--eval-fraction 0.05 with --streaming: a stream has no held-out split",
                        "pass --eval-data FILE, or --eval-fraction 0"]),
    (["--eval-fraction", "0"], ["--streaming without --steps: the length of an epoch of a stream is unknown",
                                "pass --steps N"]),
    (["--eval-fraction", "0", "--steps", "4", "--task", "classification"],
     ["--streaming with --task classification: the head's size", "drop --streaming"]),
])
def test_streaming_refuses_what_a_stream_cannot_give_at_check(tmp_path, args, fragments):
    refused(train_cli(tmp_path, "--streaming", *args, "--check"), 1, *fragments)
    assert not (tmp_path / "run").exists()
    ok = train_cli(tmp_path, "--streaming", "--steps", "4", "--eval-fraction", "0", "--check")
    assert ok.returncode == 0 and "fit to train" in ok.stdout, ok.stderr[-2000:]


def test_streaming_refuses_a_file_it_cannot_stream(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text("text\nhello there\n")
    refused(train_cli(tmp_path, "--streaming", "--steps", "4", "--eval-fraction", "0", "--check", data=rows), 1,
            "--streaming reads .jsonl/.json, .txt/.text/.md and .parquet files", "'.csv'", "drop --streaming")


def test_streaming_is_a_recipe_key_too(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: tiny-gpt2\ndata: {CORPUS}\nconfig: {train_config(tmp_path)}\nout: {tmp_path / 'run'}\n"
                      "streaming: true\neval_fraction: 0\n")
    refused(train_entry(["--recipe", str(recipe), "--check"]), 1, "--streaming without --steps", "pass --steps N")
    ok = train_entry(["--recipe", str(recipe), "--steps", "2", "--check"])
    assert ok.returncode == 0 and "fit to train" in ok.stdout, ok.stderr[-2000:]


@pytest.fixture(scope="module")
def saved_gpt2_bin(tmp_path_factory):
    """tiny-gpt2 saved as pytorch_model.bin only (an older checkpoint's format), with the byte tokenizer."""
    import torch

    from toolkit.train import hf

    folder = tmp_path_factory.mktemp("gpt2bin")
    model = hf.builtin_model("tiny-gpt2")
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    hf.byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case, words", [
    ("seq-len", ["--seq-len 4096 is longer than the model's", "positions (max_position_embeddings)"]),
    ("bin at pp 2", ["holds no safetensors", "pipeline stages (pp 2)", "save_pretrained(NEW_DIR)"]),
    ("tp without a plan", ["tensor_parallel.autotp_size 2", "has no AutoTP plan", "tp = 1"]),
])
def test_check_refuses_what_the_ranks_would_refuse_after_the_launch(tmp_path, saved_llama, saved_gpt2_bin, case,
                                                                    words):
    """--seq-len beyond the positions, a pytorch_model.bin-only folder at pp > 1 and tp over a model AutoTP cannot
    shard were refused only by the ranks; --check (what launch.sh runs first) now says so, before any launch."""
    model, cfg, seq_len = saved_llama, GOOD_CONFIG, "32"
    if case == "seq-len":
        seq_len = "4096"
    elif case == "bin at pp 2":
        model, cfg = saved_gpt2_bin, {**GOOD_CONFIG, "pipeline": {"stages": 2}}
    else:
        model, cfg = saved_gpt2_bin, ds_config(2, 2, tp=2)
    args = ["--model", str(model), "--data", str(CORPUS), "--config", str(train_config(tmp_path, cfg)),
            "--out", str(tmp_path / "run"), "--seq-len", seq_len, "--check", "--world-size", "2"]
    refused(train_entry(args), 2 if case == "bin at pp 2" else 1, *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cfg, sp, words", [
    ({}, "3", ["with --sp 3", "--world-size 2 --sp 3` reports them", "world size 2"]),
    ({"sequence_parallel_size": 4}, "2", ['"sequence_parallel_size" is 4 in the file but --sp is 2']),
])
def test_the_sp_flag_goes_through_the_config_rules_at_check(tmp_path, cfg, sp, words):
    """--sp, like --pp, fills in the config's layout: a world it does not divide, or a file saying otherwise,
    is refused by --check with the rule's message."""
    config = train_config(tmp_path, {**ds_config(2, 2), **cfg})
    args = ["--model", "tiny-llama", "--data", str(CORPUS), "--config", str(config), "--out", str(tmp_path / "run"),
            "--seq-len", "32", "--check", "--world-size", "2", "--sp", sp]
    refused(train_entry(args), 1, *words)
    if not cfg:  # a size the world divides passes
        ok = train_entry([*args[:-1], "2"])
        assert ok.returncode == 0, ok.stderr


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path):
    """--overwrite once deleted a thesis and its .git without a word: it replaces a run folder only. A run's own
    files (and a stale temporary export folder) are still replaced."""
    out = tmp_path / "work"
    (out / ".git").mkdir(parents=True)
    (out / "thesis.tex").write_text("\\documentclass{article}")
    (out / "checkpoints").mkdir()
    args = ["--model", "tiny-gpt2", "--data", str(CORPUS), "--config", str(train_config(tmp_path)), "--out", str(out),
            "--seq-len", "32", "--overwrite", "--check"]
    refused(train_entry(args), 1, "--overwrite would delete 2 file(s) no dstk run writes (.git, thesis.tex)",
            "replaces a run folder only")
    assert (out / "thesis.tex").is_file() and (out / ".git").is_dir()
    for name in (".git", "thesis.tex"):
        (out / name).rmdir() if (out / name).is_dir() else (out / name).unlink()
    (out / "metrics.jsonl").write_text("{}\n")
    (out / ".hf.dstk-abc123").mkdir()
    ok = train_entry(args)
    assert ok.returncode == 0, ok.stderr


def test_max_eval_rows_caps_the_evaluation_and_a_long_one_says_how_far_it_is(ds_world1, tmp_path, monkeypatch,
                                                                            capfd):
    """--max-eval-rows N evaluates the eval split's first N rows (HF's max_eval_samples): the loss of those rows,
    not the split's; the evaluation prints rank 0's progress line as tokenizing does (every 0 s here)."""
    from toolkit.train.runner import run

    whole = run(_args(tmp_path, out=str(tmp_path / "whole"), eval_fraction=0.2, steps=1))
    capfd.readouterr()
    monkeypatch.setenv("DSTK_PROGRESS_SECONDS", "0")
    capped = run(_args(tmp_path, out=str(tmp_path / "capped"), eval_fraction=0.2, steps=1, max_eval_rows=3,
                       progress=True))
    err = capfd.readouterr().err
    assert capped["eval_loss"] != whole["eval_loss"] and capped["first_loss"] == whole["first_loss"]
    assert "eval: 3 rows:" in err and "rows/s" in err, err[-2000:]
    same = run(_args(tmp_path, out=str(tmp_path / "same"), eval_fraction=0.2, steps=1, max_eval_rows=10**9))
    assert same["eval_loss"] == whole["eval_loss"]

