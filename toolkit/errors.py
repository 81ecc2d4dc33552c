"""The errors dstk's library raises. The CLI turns them into one clean message and an exit code."""


class ConfigError(ValueError):
    """A configuration, option or input the user can fix. The message says what and how."""


class UnusableInput(ConfigError):
    """Input that cannot be read at all (missing file, binary, broken JSON): exit code 2."""


class RankFailed(ConfigError):
    """Another rank failed with an error that is no refusal (its traceback is in that rank's output): what the
    ranks that agreed on it (toolkit.distributed.agreement) raise, so it ends them with one line, exit code 1."""


class DiskFull(UnusableInput):
    """No space left where dstk writes (a checkpoint, an export, the data cache): the folder, what was being
    written, the space free, and what is safe (toolkit.files.full_disk_is_one_line), exit code 2."""


class PortTaken(ConfigError):
    """Rank 0 cannot listen on the rendezvous port (EADDRINUSE): exit code 98, which launch.sh reads to draw another
    port when it drew this one."""

    exit_code = 98
