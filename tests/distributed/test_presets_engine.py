"""The CPU presets train under DeepSpeed's real engine in 2 processes through the deepspeed launcher
(both presets in turn in the session's one launch of scripts/engines.py, tests/distributed/conftest.py)."""

import json

import pytest


@pytest.mark.distributed
@pytest.mark.parametrize("preset,pp,dp", [("cpu_pp2.json", 2, 1), ("cpu_dp2.json", 1, 2)])
def test_cpu_preset_trains_in_two_processes(engine_runs, preset, pp, dp):
    info = json.loads((engine_runs / f"preset_{preset}").read_text())
    assert info["world"] == 2 and info["pp"] == pp
    assert len(info["losses"]) == 5 and info["losses"][-1] < info["losses"][0]
