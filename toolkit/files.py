"""Modes of the files dstk writes through temporary names.

tempfile.mkstemp / mkdtemp create 0600 files and 0700 folders (private by design). A config, a
plot or an exported model renamed into place from them would keep that mode, unreadable to the
colleagues a cluster's group permissions are meant for. `as_umask` gives them the mode a plain
open() / mkdir() would have: 0666 / 0777 less the process's umask.

write_text writes a text file atomically (temp file + rename), the one writer of dstk's small files (configs,
recipes, manifests, tracker ids). check_writable refuses, before any work, a place dstk could not write; full_disk_is_one_line turns a full disk,
wherever dstk writes, into one line that says what is safe.
"""

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import ConfigError, DiskFull

# torch's file writer reports a full disk in its own words (no errno): "[enforce fail at inline_container.cc] .
# unexpected pos ...", "PytorchStreamWriter failed writing file ...: file write failed", "basic_ios::clear"
TORCH_WRITE_FAILED = ("inline_container.cc", "PytorchStreamWriter", "basic_ios::clear", "file write failed")
LOW_SPACE = 256 * 2**20  # bytes free under which a failed torch write is taken for a full disk


def umask() -> int:
    current = os.umask(0)  # the only way to read it: set and restore at once
    os.umask(current)
    return current


def as_umask(path) -> None:
    """chmod `path` to what open() (a file) or mkdir() (a folder) would have created under the umask."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask())


def check_writable(path, flag: str, beside: bool = False) -> None:
    """`path`, or the nearest folder above it when it does not exist yet (where it would be made), must
    be a folder this process can create files in (beside=True: its parent, for what is written next to
    it and renamed into place). Tried with a real file: permissions, ACLs, read-only mounts and root all
    answer as the real write would."""
    path = Path(path).absolute()
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{flag} {path} is a link to {os.readlink(path)}, which does not exist; remove the link, "
                          f"or choose another {flag}")
    probe = path.parent if beside else path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{flag} {path}: {probe} is a file, so nothing can be made under it; choose another {flag}")
    try:
        fd, name = tempfile.mkstemp(prefix=".dstk-write-test-", dir=probe)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write in {probe} ({exc.strerror or exc}); choose a folder you can "
                          "write, or fix its permissions") from None
    os.close(fd)
    os.unlink(name)


@contextmanager
def full_disk_is_one_line(folder, doing: str, safe: str):
    """Run the block; a full disk under it (ENOSPC, a quota, or torch's writer failing with less than LOW_SPACE
    free in `folder`) is raised as DiskFull: one line naming `folder`, what was being done (`doing`), the space
    free, and `safe` (what still holds, what to do next). Every other error passes through as it is."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (re-raised unless it is a full disk)
        free = _free_bytes(folder)
        if not _is_full(exc, free):
            raise
        raise DiskFull(f"no space left on the device of {folder} while {doing} ({free / 2**20:,.0f} MiB free); "
                       f"{safe}") from None


def _is_full(exc: BaseException, free: int | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(mark in str(exc) for mark in TORCH_WRITE_FAILED) and free is not None and free < LOW_SPACE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free_bytes(folder) -> int | None:
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def write_text(text: str, path: str, force: bool = False, flag: str = "-o") -> None:
    """Write atomically (temp file + rename): a crash never leaves half a file, and an existing file
    is replaced only with force. `flag` is the option that named `path`, for the messages."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a file name such as "
                          f"{os.path.join(path, 'ds_config.json')}")
    if os.path.exists(path) and not force:
        raise ConfigError(f"{flag} {path} exists; pass --force to overwrite it, or give another file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"cannot write {flag} {path}: directory {directory} does not exist; create it first "
                          f"(mkdir -p {directory})")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dstk-", suffix=os.path.splitext(path)[1] or ".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        as_umask(tmp)  # mkstemp made it 0600
        os.replace(tmp, path)
    except OSError as exc:  # permissions, a full disk: one line, and no temp file left
        raise ConfigError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
