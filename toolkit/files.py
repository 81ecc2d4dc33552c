"""Modes of the files dstk writes through temporary names.

tempfile.mkstemp / mkdtemp create 0600 files and 0700 folders (private by design). A config, a
plot or an exported model renamed into place from them would keep that mode, unreadable to the
colleagues a cluster's group permissions are meant for. `as_umask` gives them the mode a plain
open() / mkdir() would have: 0666 / 0777 less the process's umask.

check_writable refuses, before any work, a place dstk could not write.
"""

import os
import tempfile
from pathlib import Path

from toolkit.errors import ConfigError


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
