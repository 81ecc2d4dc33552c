"""Hub ids (`--model org/name`, `--revision`) through huggingface_hub's cache, never the network.

The cache is built here as huggingface_hub lays it out: models--org--name/refs/<branch> holding a commit,
snapshots/<commit>/<file> links into blobs/. This process runs offline (tests/conftest.py sets
HF_HUB_OFFLINE=1 before anything imports huggingface_hub); the cache folder is huggingface_hub's own
constant, pointed at the test's cache (`offline_cache`). Fresh processes: tests/commands/test_hub_cache.py;
a training run from a hub id on forked ranks: tests/distributed/test_hub_run.py.
"""

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.invoke import invoke_dstk
from toolkit.errors import UnusableInput
from models.weights import hub

REPO_ID = "dstk-test/tiny-llama"
LAYERS = {"main": 4, "v2": 2}  # tiny-llama's blocks at each branch of the cached repository


def commit_of(ref: str) -> str:
    return hashlib.sha1(ref.encode()).hexdigest()  # 40 hex digits, as a git commit


def fill_cache(cache: Path, repo_id: str, snapshots: dict) -> Path:
    """Lay out `snapshots` ({branch: a folder of files}) as huggingface_hub caches repo_id: blobs/<sha256>,
    snapshots/<commit>/<name> -> ../../blobs/<sha256>, refs/<branch> = the commit. Returns the repo's folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for ref, folder in snapshots.items():
        commit = commit_of(ref)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
        for file in sorted(Path(folder).iterdir()):
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, blob)
            link = repo / "snapshots" / commit / file.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return repo


def saved_tiny_llama(folder: Path, **sizes) -> Path:
    """tiny-llama (random weights from seed 0) and the byte tokenizer, as save_pretrained writes them."""
    from toolkit.train import hf

    hf.builtin_model("tiny-llama", **sizes).save_pretrained(folder)
    hf.byte_tokenizer().save_pretrained(folder)
    return folder


def tiny_llama_cache(root: Path) -> Path:
    """A cache holding REPO_ID at main (4 blocks) and v2 (2 blocks)."""
    cache = root / "hub"
    fill_cache(cache, REPO_ID, {ref: saved_tiny_llama(root / ref, num_hidden_layers=n) for ref, n in LAYERS.items()})
    return cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tiny_llama_cache(tmp_path_factory.mktemp("hf"))


@pytest.fixture
def offline_cache(cache, monkeypatch) -> Path:
    """huggingface_hub's cache folder is `cache`, offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def snapshot_dir(cache: Path, ref: str) -> str:
    return str(cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / commit_of(ref))


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert hub.is_hub_id("meta-llama/Llama-3.2-1B") and hub.is_hub_id("Qwen/Qwen2.5-0.5B")
    for name in ("tiny-gpt2", "org/local", "./org/name", "a/b/c", "org/", "/abs/path", "org/na--me", "org/name."):
        assert not hub.is_hub_id(name), name


def test_a_branch_a_tag_or_a_commit_picks_its_snapshot(offline_cache):
    assert hub.snapshot(REPO_ID) == snapshot_dir(offline_cache, "main")
    assert hub.snapshot(REPO_ID, "v2") == snapshot_dir(offline_cache, "v2")
    assert hub.snapshot(REPO_ID, commit_of("v2")) == snapshot_dir(offline_cache, "v2")
    assert hub.cached(REPO_ID, "v3") is None


@pytest.mark.parametrize("repo_id, revision, held", [("dstk-test/absent", "main", ""),
                                                     (REPO_ID, "v3", " (it holds revision(s) main, v2)")])
def test_an_id_the_cache_lacks_is_refused_at_once_offline(offline_cache, repo_id, revision, held):
    start = time.monotonic()
    with pytest.raises(UnusableInput) as info:
        hub.snapshot(repo_id, revision, flag="--model")
    assert time.monotonic() - start < 2  # the hub is not contacted: no retries
    message = str(info.value)
    for words in (f"--model {repo_id}: no such local directory", f"cache {offline_cache} at revision {revision}{held}",
                  "HF_HUB_OFFLINE is set", f"`hf download {repo_id} --revision {revision}`"):
        assert words in message, message


def test_plan_and_partition_read_the_config_at_the_revision(offline_cache):
    from toolkit.plan.arch import load_arch
    from toolkit.plan.layouts.planner import PlanRequest, make_plan

    assert (load_arch(REPO_ID).layers, load_arch(REPO_ID, "v2").layers) == (LAYERS["main"], LAYERS["v2"])
    assert load_arch(REPO_ID).name == REPO_ID
    assert make_plan(PlanRequest(model=REPO_ID, gbs=8, gpus_per_node=2, gpu="a100-80gb")).fitting
    result = invoke_dstk(["partition", REPO_ID, "--pp", "2", "--revision", "v2", "--json"])
    assert result.returncode == 0, result.stderr
    assert '"num_layers": 5' in result.stdout  # embedding, 2 blocks, norm, head
    (offline_cache.parent / "ds.json").write_text('{"train_batch_size": 8}')
    result = invoke_dstk(["validate", str(offline_cache.parent / "ds.json"), "--model", REPO_ID])
    assert result.returncode == 0, result.stderr
    refused = invoke_dstk(["plan", "--model", "dstk-test/absent", "--gbs", "8", "--gpu", "a100-80gb"])
    assert refused.returncode == 2 and "hf download dstk-test/absent" in refused.stderr, refused.stderr


def test_parity_wraps_the_cached_model(offline_cache):
    from toolkit.train.parity import run_parity

    report = run_parity(REPO_ID, seq_len=8, revision="v2")
    assert report.ok and report.model == REPO_ID and report.num_layers == LAYERS["v2"] + 3


def test_train_check_reads_the_cached_folder_and_resume_compares_folders(offline_cache, tmp_path):
    from toolkit.train.job import run_identity
    from toolkit.train.runner import TrainArgs, local_inputs

    from tests.unit.test_train_refusals import CORPUS, train_config, train_entry

    base = ["--data", str(CORPUS), "--config", str(train_config(tmp_path)), "--out", str(tmp_path / "run"),
            "--seq-len", "32", "--check"]
    for model, revision in ((REPO_ID, "main"), (REPO_ID, "v2"), ("tiny-gpt2", "v3")):  # a built-in ignores it
        result = train_entry(["--model", model, "--revision", revision, *base])
        assert result.returncode == 0, result.stderr
    result = train_entry(["--model", "tiny-gpt2", "--tokenizer", REPO_ID, *base])
    assert result.returncode == 0, result.stderr
    args = TrainArgs(model=REPO_ID, data=str(CORPUS), config="ds.json", tokenizer=REPO_ID, revision="v2")
    local = local_inputs(args)
    assert (local.model, local.tokenizer) == (snapshot_dir(offline_cache, "v2"),) * 2
    assert local.hub_ids == {"--model": REPO_ID, "--tokenizer": REPO_ID}
    by_id, by_folder = run_identity(local), run_identity(local_inputs(TrainArgs(model=local.model, data=str(CORPUS),
                                                                                config="ds.json", tokenizer=local.model)))
    assert {k: by_id[k] for k in ("model", "tokenizer", "data")} == {k: by_folder[k] for k in ("model", "tokenizer", "data")}
    assert by_id["hub"] == {"--model": REPO_ID, "--tokenizer": REPO_ID, "--revision": "v2"}


@pytest.mark.parametrize("fault", ["blob deleted", "ref to a missing commit", "typo"])
def test_a_damaged_cache_or_a_typo_is_named_for_what_it_is(tmp_path, monkeypatch, fault):
    """A blob deleted under a snapshot's link once read "holds no weights ... pass a built-in name"; refs/main
    naming a commit whose snapshot is gone, "holds revision(s) main"; a typo got no hint."""
    from huggingface_hub import constants

    cache = tiny_llama_cache(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    name, revision = REPO_ID, "main"
    if fault == "blob deleted":
        os.remove(Path(snapshot_dir(cache, "main")) / "model.safetensors")  # the link's target: its blob
        link = Path(snapshot_dir(cache, "main")) / "model.safetensors"
        link.symlink_to(repo / "blobs" / "gone")
        words = [f"{link} is a broken link (its blob is gone from the cache", "--force-download"]
    elif fault == "ref to a missing commit":
        (repo / "refs" / "main").write_text("0" * 40)
        words = ["its refs/main names commit 000000000000, whose snapshot folder is gone", "(a damaged cache)"]
    else:
        name = REPO_ID[:-2] + REPO_ID[-1] + REPO_ID[-2]  # two letters swapped
        words = [f"did you mean {REPO_ID}? the cache holds it"]
    with pytest.raises(UnusableInput) as info:
        hub.snapshot(name, revision, flag="--model")
    assert all(w in str(info.value) for w in words), str(info.value)
