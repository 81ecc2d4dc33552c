"""The CPU presets train under DeepSpeed's real engine in 2 processes through the deepspeed launcher."""

import json
from pathlib import Path

import pytest

from tests.distributed.launch import run_deepspeed
from toolkit.config.presets import PRESET_DIR

SCRIPT = Path(__file__).parent / "scripts" / "preset_engine.py"


@pytest.mark.distributed
@pytest.mark.parametrize("preset,pp,dp", [("cpu_pp2.json", 2, 1), ("cpu_dp2.json", 1, 2)])
def test_cpu_preset_trains_in_two_processes(tmp_path, preset, pp, dp):
    out = tmp_path / "out.json"
    run_deepspeed(SCRIPT, PRESET_DIR / preset, out, num_procs=2)
    info = json.loads(out.read_text())
    assert info["world"] == 2 and info["pp"] == pp
    assert len(info["losses"]) == 5 and info["losses"][-1] < info["losses"][0]
