"""The errors dstk's library raises. The CLI turns them into one clean message and an exit code."""


class ConfigError(ValueError):
    """A configuration, option or input the user can fix. The message says what and how."""


class UnusableInput(ConfigError):
    """Input that cannot be read at all (missing file, binary, broken JSON): exit code 2."""


class RankFailed(ConfigError):
    """Another rank failed with an error that is no refusal (its traceback is in that rank's output): what the
    ranks that agreed on it (toolkit.distributed.agreement) raise, so it ends them with one line, exit code 1."""
