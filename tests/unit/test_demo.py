"""The demo (toolkit/train/demo.py) on machines with 0, 1 and 2+ GPUs: its two pipeline stages need two
devices, so with one GPU they run as CPU processes and it says why (NCCL refuses two ranks on one GPU)."""

import pytest

from toolkit.train.demo import demo_config, on_cpu_because


@pytest.mark.parametrize("gpus, cpu", [(0, False), (1, True), (2, False), (8, False)])
def test_one_gpu_runs_the_demo_on_cpu_and_says_why(gpus, cpu):
    why = on_cpu_because(gpus)
    assert (why is not None) == cpu
    if cpu:
        assert "NCCL refuses two ranks on one GPU" in why


def test_the_demo_config_is_a_two_stage_pipeline_without_jit_built_ops(tmp_path):
    import json

    cfg = json.loads(demo_config(tmp_path, 1e-3).read_text())
    assert cfg["pipeline"]["stages"] == 2 and cfg["optimizer"]["params"]["torch_adam"] is True
