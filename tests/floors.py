"""The declared floors of dstk's requirements as pins, for `make test-floor`.

    python tests/floors.py              # name==floor for every install_requires entry of setup.cfg
    python tests/floors.py torch        # one pin: torch==2.7
    .venv-floor/bin/python tests/floors.py --installed   # is each installed at its floor? (exit 1 if not)

Read from setup.cfg itself, so the floor check installs what setup.cfg declares and the two never drift.
Standard library only: it runs under the bare interpreter that creates the floor venv.
"""

import configparser
import re
import sys
from pathlib import Path

SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_FLOOR = re.compile(r">=\s*([^,;\s]+)")


def requirements(setup_cfg: Path = SETUP_CFG) -> list[str]:
    """The install_requires entries of setup.cfg's [options], comments and blank lines left out."""
    parser = configparser.ConfigParser()  # as setuptools reads it: whole-line comments only
    parser.read(setup_cfg)
    lines = parser.get("options", "install_requires").splitlines()
    return [line.strip() for line in lines if line.strip()]


def pin(requirement: str) -> str:
    """'torch>=2.6,<2.15' -> 'torch==2.6'; a requirement with no '>=' floor is refused: the check could not
    test it."""
    name, floor = _NAME.match(requirement), _FLOOR.search(requirement)
    if name is None or floor is None:
        raise ValueError(f"setup.cfg install_requires {requirement!r} has no '>=' floor: give it one (the "
                         "lowest version the suite passes on; make test-floor installs it)")
    return f"{name.group(1)}=={floor.group(1)}"


def pins(setup_cfg: Path = SETUP_CFG) -> dict[str, str]:
    """{lower-cased name: 'name==floor'} for every requirement."""
    return {_NAME.match(r).group(1).lower(): pin(r) for r in requirements(setup_cfg)}


def _release(version: str) -> tuple:
    """'2.7.0+cu126' -> (2, 7), trailing zeros dropped, so that it equals the floor '2.7'."""
    parts = [int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group().split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check_installed(table: dict[str, str]) -> list[str]:
    """'name floor: installed X' for each requirement this interpreter does not have at its floor."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for name, pinned in table.items():
        floor = pinned.split("==")[1]
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "none"
        if have == "none" or _release(have) != _release(floor):
            wrong.append(f"{name} {floor}: installed {have}")
    return wrong


def main(argv: list[str]) -> int:
    try:
        table = pins()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if argv == ["--installed"]:
        from importlib.metadata import version

        wrong = check_installed(table)
        if wrong:
            print(f"not at setup.cfg's floors: {'; '.join(wrong)}", file=sys.stderr)
            return 1
        print("at setup.cfg's floors: " + ", ".join(f"{name} {version(name)}" for name in table))
        return 0
    unknown = [name for name in argv if name.lower() not in table]
    if unknown:
        print(f"not in setup.cfg install_requires: {', '.join(unknown)} (have: {', '.join(table)})", file=sys.stderr)
        return 1
    print("\n".join(table[name.lower()] for name in argv) if argv else "\n".join(table.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
