"""One problem found in a config: where (a JSON path), how bad, and what to do."""

from dataclasses import asdict, dataclass

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
