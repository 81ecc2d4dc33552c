"""Modes of the files dstk writes through temporary names.

tempfile.mkstemp / mkdtemp create 0600 files and 0700 folders (private by design). A config, a
plot or an exported model renamed into place from them would keep that mode, unreadable to the
colleagues a cluster's group permissions are meant for. `as_umask` gives them the mode a plain
open() / mkdir() would have: 0666 / 0777 less the process's umask.
"""

import os


def umask() -> int:
    current = os.umask(0)  # the only way to read it: set and restore at once
    os.umask(current)
    return current


def as_umask(path) -> None:
    """chmod `path` to what open() (a file) or mkdir() (a folder) would have created under the umask."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask())
