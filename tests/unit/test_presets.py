"""Every shipped preset is exactly what its recorded generate-config command prints, and validates."""

import pytest

from toolkit.cli.generate import render
from toolkit.config.presets import PRESET_DIR, load_presets

PRESETS = load_presets()


def test_every_json_in_ds_configs_is_recorded():
    assert sorted(p.name for p in PRESET_DIR.glob("*.json")) == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_regenerated_identically(name):
    assert (PRESET_DIR / name).read_text() == render(PRESETS[name]), f"run `make presets` to refresh {name}"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_for_its_own_topology(name):
    from toolkit.cli.validate import check_file

    args = PRESETS[name]
    world = int(args[args.index("--world-size") + 1]) if "--world-size" in args else None
    report = check_file(str(PRESET_DIR / name), world_size=world)
    assert report["code"] == 0, report["problems"]
