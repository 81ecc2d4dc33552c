"""Rank 0's opening block (toolkit.train.report.progress.start_lines): its layout line names every axis of the
world (sp included, which it left out: "dp 1 x pp 1 x tp 1 = 1 ranks" on an sp 2 run of 2 ranks) and, at
pp > 1, the pipeline schedule. A run's own block: tests/distributed/test_train.py, test_sp_precision.py."""

import pytest


@pytest.mark.parametrize("layout, line", [
    ({"dp": 1, "pp": 1, "tp": 1, "sp": 2, "schedule": None}, "layout: dp 1 x pp 1 x tp 1 x sp 2 = 2 ranks, ZeRO 1;"),
    ({"dp": 2, "pp": 2, "tp": 1, "sp": 2, "schedule": "dualpipev"},
     "layout: dp 2 x pp 2 x tp 1 x sp 2 = 8 ranks, schedule dualpipev, ZeRO 1;"),
])
def test_the_layout_line_names_sp_and_the_schedule(layout, line):
    from toolkit.train.report.progress import start_lines

    about = {"layout": {**layout, "zero_stage": 1}, "model": "tiny-llama", "model_name": "tiny-llama",
             "from_dir": False, "seed": 1, "dtype": "bf16", "params": 1000, "trainable": 1000, "mbs": 2, "gas": 4,
             "gbs": 8 * layout["dp"], "seq_len": 32, "start_step": 0, "steps": 4}
    assert start_lines(about)[1].startswith(line), start_lines(about)[1]


def test_one_rank_and_a_resume_written_under_sp_and_ep_say_so():
    from toolkit.train.report.progress import start_lines

    about = {"layout": {"dp": 1, "pp": 1, "tp": 1, "sp": 1, "zero_stage": 1}, "model": "tiny-mixtral",
             "model_name": "tiny-mixtral", "from_dir": False, "seed": 1, "dtype": "fp32", "params": 1000,
             "trainable": 1000, "mbs": 2, "gas": 4, "gbs": 8, "seq_len": 32, "start_step": 4, "steps": 8,
             "resume": {"tag": "global_step4", "saved": {"dp": 4, "pp": 1, "tp": 1, "sp": 2, "zero_stage": 1,
                                                         "expert_parallel": 2}}}
    lines = start_lines(about)
    assert "= 1 rank," in lines[1], lines[1]
    assert any("written on dp 4 x pp 1 x tp 1 x sp 2, ep 2, ZeRO 1; steps 5..8" in line for line in lines), lines
