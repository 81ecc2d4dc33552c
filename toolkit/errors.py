"""The errors dstk's library raises. The CLI turns them into one clean message and an exit code."""


class ConfigError(ValueError):
    """A configuration, option or input the user can fix. The message says what and how."""


class UnusableInput(ConfigError):
    """Input that cannot be read at all (missing file, binary, broken JSON): exit code 2."""
