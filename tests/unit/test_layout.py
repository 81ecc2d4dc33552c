"""The package reads as a map: a few top-level modules, one room per concept, no import circles.

Imports are read with `ast` (nothing is imported), including the lazy ones inside functions: a
circle that only closes at run time is still a circle.
"""

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("toolkit", "models")


def _modules(packages=PACKAGES) -> dict:
    """dotted module name -> path, for every .py file of the packages."""
    found = {}
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()
SOURCES = {**MODULES, **_modules(("tests", "bench"))}


def _imports(name: str, path: Path) -> list:
    """(imported module, [names], line) for every import statement in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            out += ([(base, [n for n in names if f"{base}.{n}" not in MODULES], node.lineno)]
                    + [(m, [], node.lineno) for m in submodules])
    return out


def _graph() -> dict:
    """module -> the project modules it imports (a package import counts as its __init__)."""
    return {name: {target for target, _, _ in _imports(name, path) if target in MODULES and target != name}
            for name, path in MODULES.items()}


# Imports run one way, down the layers ARCHITECTURE.md draws: cli -> train -> export / checkpoint -> distributed ->
# data / config / plan -> models -> errors, files. Each room and the higher rooms it never imports, not even inside
# a function: what two rooms need lives in the lower one.
FORBIDDEN = {
    "models": ("toolkit.cli", "toolkit.train", "toolkit.export", "toolkit.checkpoint", "toolkit.distributed",
               "toolkit.data", "toolkit.config", "toolkit.plan"),
    "toolkit.plan": ("toolkit.cli", "toolkit.train", "toolkit.export", "toolkit.checkpoint", "toolkit.distributed"),
    "toolkit.config": ("toolkit.cli", "toolkit.train", "toolkit.export", "toolkit.checkpoint"),
    "toolkit.data": ("toolkit.cli", "toolkit.train", "toolkit.export", "toolkit.checkpoint"),
    "toolkit.distributed": ("toolkit.cli", "toolkit.train"),
    "toolkit.checkpoint": ("toolkit.cli", "toolkit.train"),
    "toolkit.export": ("toolkit.cli", "toolkit.train"),
}


def _inside(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def _upward_imports(modules: dict, root: Path = REPO) -> list:
    """'file:line: module imports target (room may not import higher)' for every import that runs up."""
    found = []
    for name, path in modules.items():
        for room, higher in FORBIDDEN.items():
            if not _inside(name, room):
                continue
            for target, _, line in _imports(name, path):
                found += [f"{path.relative_to(root)}:{line}: {name} imports {target} ({room} may not import {above})"
                          for above in higher if _inside(target, above)]
    return found


def test_imports_run_one_way_down_the_layers():
    assert _upward_imports(MODULES) == []


def test_an_upward_import_is_named_with_its_file_and_line(tmp_path):
    """The check above finds a lazy import inside a function too (a fabricated module: plan reaching into train)."""
    module = tmp_path / "toolkit" / "plan" / "reach.py"
    module.parent.mkdir(parents=True)
    module.write_text("import os\n\n\ndef f():\n    from toolkit.train.hf import byte_tokenizer\n")
    assert _upward_imports({"toolkit.plan.reach": module}, root=tmp_path) == [
        "toolkit/plan/reach.py:5: toolkit.plan.reach imports toolkit.train.hf (toolkit.plan may not import toolkit.train)"]


def test_top_level_holds_only_the_package_face():
    assert sorted(p.name for p in (REPO / "toolkit").glob("*.py")) == ["__init__.py", "errors.py", "files.py"]


def test_one_process_group_bootstrap():
    """The shm_comm switch-off, the free port and the world-of-one set-up live in toolkit/distributed/process_group.py only."""
    for needle in ("deepspeed_shm_comm", "init_distributed(", "socket.socket("):
        holders = sorted(str(p.relative_to(REPO)) for p in REPO.glob("*/**/*.py")
                         if p.parts[len(REPO.parts)] in ("toolkit", "models", "tests", "bench")
                         and needle in p.read_text() and p.name != "test_layout.py")
        assert holders == ["toolkit/distributed/process_group.py"], (needle, holders)


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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def test_no_private_names_imported_across_modules():
    """A private name is its module's own: make it public in its room, or move the caller. Tests and
    benchmarks hold to it too."""
    crossing = [f"{path.relative_to(REPO)} imports {target}.{n}" for name, path in SOURCES.items()
                for target, names, _ in _imports(name, path) if target in MODULES and target != name
                for n in names if _private(n)]
    assert crossing == []


def test_no_private_attribute_of_another_module():
    """`portable._x` from outside portable.py reaches as far as importing it."""
    reached = []
    for name, path in SOURCES.items():
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> project module, from `from a import b [as c]` / `import a.b as c`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                bound.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names
                              if f"{node.module}.{alias.name}" in MODULES})
            elif isinstance(node, ast.Import):
                bound.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in MODULES})
        reached += [f"{path.relative_to(REPO)}:{node.lineno}: {bound[node.value.id]}.{node.attr}"
                    for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and bound[node.value.id] != name and _private(node.attr)]
    assert sorted(set(reached)) == []


FOLDERS = sorted({path.parent for path in MODULES.values()})
MAX_MODULES = 10  # per folder, __init__.py not counted


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: str(f.relative_to(REPO)))
def test_rooms_are_small_and_have_no_prefix_families(folder):
    """No folder past ten modules, and no three modules sharing a name prefix (data_a, data_b, data_c
    is a subpackage asking to exist)."""
    names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    assert len(names) <= MAX_MODULES, f"{folder.relative_to(REPO)}: {len(names)} modules: {sorted(names)}"
    prefixes = Counter(n.split("_")[0] for n in names if "_" in n.strip("_"))
    families = {prefix: count + (prefix in names) for prefix, count in prefixes.items() if count + (prefix in names) >= 3}
    assert families == {}, f"{folder.relative_to(REPO)}: modules sharing a name prefix: {families}"


def test_no_function_named_after_its_module():
    """`loop.loop` says nothing the module's name did not. Click commands are exempt: toolkit/cli has
    one module per command, named as the command (`dstk export` is toolkit.cli.export:export)."""
    same = [f"{name}.{node.name}" for name, path in MODULES.items() if not name.startswith("toolkit.cli")
            for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name.rpartition(".")[2]]
    assert same == []


def test_the_package_map_names_every_module_and_subpackage_of_each_room():
    """ARCHITECTURE.md's table of rooms names each module (`name.py`) and subpackage (`name/`) directly inside a
    room, so a module that moves or appears moves or appears there too. toolkit/cli/ is one module per command
    (toolkit.cli.COMMANDS)."""
    rooms_table = (REPO / "ARCHITECTURE.md").read_text().split("## The rooms", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([\w/]+)/` \| (.*)$", rooms_table, re.M))
    rooms = [REPO / "models"] + [p for p in sorted((REPO / "toolkit").iterdir())
                                 if (p / "__init__.py").is_file() and p.name != "cli"]
    unnamed = []
    for room in rooms:
        row = rows.get(str(room.relative_to(REPO)), "")
        for entry in sorted(room.iterdir()):
            if (entry / "__init__.py").is_file():
                word = f"{entry.name}/"
            elif entry.suffix == ".py" and entry.stem not in ("__init__", "__main__"):
                word = entry.name
            else:
                continue
            if f"`{word}" not in row:
                unnamed.append(str(entry.relative_to(REPO)))
    assert unnamed == [], "ARCHITECTURE.md's table of rooms does not name these"
