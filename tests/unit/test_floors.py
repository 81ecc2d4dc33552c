"""tests/floors.py: the pins `make test-floor` installs are setup.cfg's floors, and a requirement without one is
refused (the floor check could not test it)."""

import re

import pytest

from tests import floors


def test_every_requirement_is_pinned_at_its_floor():
    table = floors.pins()
    reqs = floors.requirements()
    assert len(table) == len(reqs) and {"torch", "deepspeed", "transformers"} <= set(table)
    for req in reqs:
        name = re.match(r"[A-Za-z0-9._-]+", req).group()
        floor = table[name.lower()].split("==")[1]
        assert f">={floor}" in req.replace(" ", ""), (req, table[name.lower()])


def test_a_requirement_without_a_floor_is_refused(tmp_path):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[options]\ninstall_requires =\n    # a comment line is no requirement\n    torch>=2.7,<2.15\n"
                   "    hjson<4\n")
    assert floors.requirements(cfg) == ["torch>=2.7,<2.15", "hjson<4"]
    with pytest.raises(ValueError, match=r"'hjson<4' has no '>=' floor"):
        floors.pins(cfg)


def test_installed_versions_are_compared_by_release():
    assert floors._release("2.7.0+cu126") == floors._release("2.7") == (2, 7)
    assert floors._release("6.0") == floors._release("6") and floors._release("0.19.8") != floors._release("0.19")
    assert floors.check_installed({"pytest": f"pytest=={pytest.__version__}"}) == []
    assert floors.check_installed({"pytest": "pytest==0.1"}) == [f"pytest 0.1: installed {pytest.__version__}"]
    assert floors.check_installed({"no-such-dist": "no-such-dist==1.0"}) == ["no-such-dist 1.0: installed none"]
