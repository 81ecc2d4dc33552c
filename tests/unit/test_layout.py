"""The package reads as a map: a few top-level modules, one room per concept, no import circles.

Imports are read with `ast` (nothing is imported), including the lazy ones inside functions: a
circle that only closes at run time is still a circle.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("toolkit", "models")


def _modules() -> dict:
    """dotted module name -> path, for every .py file of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list:
    """(imported module, [names]) for every import statement in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            out += [(base, [n for n in names if f"{base}.{n}" not in MODULES])] + [(m, []) for m in submodules]
    return out


def _graph() -> dict:
    """module -> the project modules it imports (a package import counts as its __init__)."""
    return {name: {target for target, _ in _imports(name, path) if target in MODULES and target != name}
            for name, path in MODULES.items()}


def test_top_level_holds_only_the_package_face():
    assert sorted(p.name for p in (REPO / "toolkit").glob("*.py")) == ["__init__.py", "dist.py", "errors.py",
                                                                       "files.py", "topology.py"]


def test_one_process_group_bootstrap():
    """The shm_comm switch-off, the free port and the world-of-one set-up live in toolkit/dist.py only."""
    for needle in ("deepspeed_shm_comm", "init_distributed(", "socket.socket("):
        holders = sorted(str(p.relative_to(REPO)) for p in REPO.glob("*/**/*.py")
                         if p.parts[len(REPO.parts)] in ("toolkit", "models", "tests", "bench")
                         and needle in p.read_text() and p.name != "test_layout.py")
        assert holders == ["toolkit/dist.py"], (needle, holders)


def test_no_import_circles():
    graph = _graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue  # a package's __init__ importing its own submodule is not a circle
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def _room(module: str) -> str:
    """The package a module belongs to for the privacy rule: models, toolkit.cli, toolkit.train, ..."""
    parts = module.split(".")
    if len(parts) > 1 and (REPO / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def test_no_private_names_imported_across_packages():
    crossing = [f"{name} imports {target}.{n}" for name, path in MODULES.items()
                for target, names in _imports(name, path) if target in MODULES and _room(target) != _room(name)
                for n in names if n.startswith("_") and not n.endswith("__")]
    assert crossing == []
