"""One problem found in a config: where (a JSON path), how bad, and what to do."""

from dataclasses import asdict, dataclass

from toolkit.errors import ConfigError

ERROR = "error"
WARNING = "warning"
NOTE = "note"


@dataclass(frozen=True)
class Problem:
    path: str  # JSON path as the user wrote the keys, e.g. "$.zero_optimization.stage"
    message: str  # quotes the key as written, shows the numbers, suggests the fix
    severity: str = ERROR  # ERROR makes the file invalid; WARNING and NOTE do not

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def has_errors(problems) -> bool:
    return any(p.severity == ERROR for p in problems)


def raise_errors(problems, source: str, why: str = "is not a valid DeepSpeed config", flags: str = "") -> None:
    """ConfigError listing every ERROR (one per line, as `dstk validate` prints them), if any. flags: the
    validate options that give the same report (" --world-size 2 --sp 3")."""
    errors = [p for p in problems if p.severity == ERROR]
    if errors:
        raise ConfigError(f"{source} {why}: {len(errors)} error(s), as `dstk validate {source}{flags}` reports them:\n  "
                          + "\n  ".join(str(p) for p in errors))
