"""Hub ids (`--model org/name`, `--tokenizer org/name`, at `--revision`) -> a folder in huggingface_hub's cache.

The one place dstk turns a hub id into a local directory, as from_pretrained finds one; every command then
reads that folder as it reads `--model DIR`. The cache (HF_HUB_CACHE, default HF_HOME/hub, i.e.
~/.cache/huggingface/hub) holds per repository

    models--org--name/refs/main              the commit a branch or tag names (40 hex digits)
    models--org--name/snapshots/<commit>/    that commit's files (links into blobs/)

Online, what the cache lacks is downloaded first (once per node in training: toolkit.train.runner);
offline (HF_HUB_OFFLINE=1) the hub is never contacted, and an id the cache lacks is refused at once with
the command that fills it. A built-in name (toolkit.plan.arch) and an existing path are never hub ids.

    is_hub_id("meta-llama/Llama-3.2-1B")              # True: org/name, and no such local path
    cached("meta-llama/Llama-3.2-1B", "main")         # its snapshot folder from the cache alone, or None
    snapshot("meta-llama/Llama-3.2-1B", "main")       # the folder; online, downloads what is missing first
"""

import difflib
import os
import re

from toolkit.errors import UnusableInput

ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # huggingface_hub's repo id: org/name
# What from_pretrained reads of a model and its tokenizer: configs, safetensors weights, tokenizer files
# (vocab/merges .txt, sentencepiece .model, chat_template.jinja). Not .bin/.pth/.gguf copies of the weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
CONFIG_FILES = ["config.json"]  # what the planner reads (dstk plan, partition, validate)


def is_hub_id(name) -> bool:
    """Whether `name` reads as a hub model id (org/name, as huggingface_hub validates one) and is no local path."""
    name = str(name)
    return (len(name) <= 96 and ID.fullmatch(name) is not None and "--" not in name and ".." not in name
            and not os.path.exists(name))


def cache_folder() -> str:
    """huggingface_hub's cache folder, as from_pretrained reads it (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: the hub is not contacted."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached(repo_id: str, revision: str = "main", files=MODEL_FILES) -> str | None:
    """The snapshot folder of `repo_id` at `revision` (a branch, tag or commit) from the cache alone (refs/,
    snapshots/; no network); None when the cache lacks it, or knows it is incomplete for `files`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_folder(), allow_patterns=files,
                                 local_files_only=True)
    except LocalEntryNotFoundError:  # IncompleteSnapshotError included
        return None


def snapshot(repo_id: str, revision: str = "main", flag: str = "--model", files=MODEL_FILES,
             download: bool = True) -> str:
    """The snapshot folder of `repo_id` at `revision`. Online and with `download`, what the cache lacks of
    `files` is downloaded first (as from_pretrained does); else (offline: HF_HUB_OFFLINE) from the cache
    alone. Refused at once, naming the id, the revision, the cache and the command that fills it, when
    neither gives the folder."""
    if download and not offline():
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(repo_id, revision=revision, cache_dir=cache_folder(), allow_patterns=files)
        except Exception as exc:  # noqa: BLE001  HTTP, proxy, disk, gated repo...: one refusal naming the cause
            first = (str(exc).strip().splitlines() or [""])[0]
            raise missing(repo_id, revision, flag, f"downloading it failed ({type(exc).__name__}: {first})") from None
    folder = cached(repo_id, revision, files)
    if folder is None:
        raise missing(repo_id, revision, flag, "HF_HUB_OFFLINE is set, so the hub is not contacted" if offline()
                      else "it has not been downloaded")
    check_links(folder, repo_id, revision, flag)
    return folder


def check_links(folder: str, repo_id: str, revision: str, flag: str) -> None:
    """A snapshot's files are links into the cache's blobs/: one whose blob is gone (deleted, a cache cleaned by
    hand) is named as such, not read as a folder that lacks the file."""
    broken = sorted(name for name in os.listdir(folder)
                    if os.path.islink(os.path.join(folder, name)) and not os.path.exists(os.path.join(folder, name)))
    if broken:
        shown = ", ".join(broken[:3]) + (", ..." if len(broken) > 3 else "")
        raise UnusableInput(f"{flag} {repo_id}: {os.path.join(folder, broken[0])} is a broken link (its blob is gone "
                            f"from the cache; {len(broken)} file(s): {shown}). Fetch them again with `hf download "
                            f"{repo_id} --revision {revision} --force-download`")


def missing(repo_id: str, revision: str, flag: str, why: str) -> UnusableInput:
    """The refusal of an id the cache lacks: where dstk looked, what it holds of the id, and how to fill it."""
    repo = os.path.join(cache_folder(), "models--" + repo_id.replace("/", "--"))
    refs = sorted(os.listdir(os.path.join(repo, "refs"))) if os.path.isdir(os.path.join(repo, "refs")) else []
    held = f" (it holds revision(s) {', '.join(refs)})" if refs else ""
    dangling = _dangling_ref(repo, revision)
    if dangling:
        held, why = "", dangling
    elif not os.path.isdir(repo):
        close = difflib.get_close_matches(repo_id, cached_ids(), n=1, cutoff=0.6)
        held = f" (did you mean {close[0]}? the cache holds it)" if close else ""
    return UnusableInput(f"{flag} {repo_id}: no such local directory, and the hub id is not in the Hugging Face cache "
                         f"{cache_folder()} at revision {revision}{held}: {why}. Fill the cache with `hf download "
                         f"{repo_id} --revision {revision}` (where the hub can be reached; HF_HUB_CACHE or HF_HOME "
                         "name the cache), or pass a local directory")


def _dangling_ref(repo: str, revision: str) -> str | None:
    """Why refs/REVISION leads nowhere, where it names a commit whose snapshot folder is gone (else None)."""
    ref = os.path.join(repo, "refs", revision)
    try:
        commit = open(ref).read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if commit and not os.path.isdir(os.path.join(repo, "snapshots", commit)):
        return (f"its refs/{revision} names commit {commit[:12]}, whose snapshot folder is gone from the cache "
                f"(a damaged cache)")
    return None


def cached_ids() -> list:
    """The model ids the cache holds (models--org--name folders)."""
    try:
        names = os.listdir(cache_folder())
    except OSError:
        return []
    return [n.removeprefix("models--").replace("--", "/", 1) for n in names if n.startswith("models--")]
