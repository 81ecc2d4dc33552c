"""`dstk train --schedule dualpipev --check`: what DeepSpeed's DualPipeVEngine would assert on every rank
after the build (runtime/pipe/dualpipev.py), refused before any process starts: one message naming the
flag, the numbers and the fix, exit 1, no traceback."""

import pytest

from tests.configs import ds_config, write_config
from tests.unit.test_train_refusals import refused, train_cli


def check(tmp_path, cfg, *args):
    return train_cli(tmp_path, "--schedule", "dualpipev", "--check", *args,
                     config=write_config(tmp_path / "ds.json", cfg))


def test_a_dualpipev_run_that_fits_passes_the_check(tmp_path):
    ok = check(tmp_path, ds_config(2, 4, pp=2), "--world-size", "2")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok:"), ok.stdout


@pytest.mark.parametrize("cfg, args, said", [
    (ds_config(2, 3, pp=2), (), ["at least 2 x pp = 4 micro-batches", "gradient_accumulation_steps is 3",
                                 '"gradient_accumulation_steps": 4']),
    (ds_config(2, 4, pp=4), ("--world-size", "4"), ["2 x pp = 8 micro-batches", "is 4", "--schedule 1f1b"]),
    ({**ds_config(2, pp=2), "gradient_accumulation_steps": None, "train_batch_size": 12}, ("--world-size", "4"),
     ["2 x pp = 4 micro-batches", "is 3"]),  # derived: 12 / (2 x dp 2)
    (ds_config(2, 4), (), ["needs pipeline stages: pp is 1", "--pp 2"]),
    (ds_config(2, 8, pp=2, tp=2), (), ['"autotp_size": 2', "pipe_partitioned", "tp 1 or --schedule 1f1b"]),
    (ds_config(2, 8, pp=2, sequence_parallel_size=2), ("--attention", "sdpa"),
     ['"sequence_parallel_size": 2', "sequence_parallel_size 1 or --schedule 1f1b"]),
    (ds_config(2, 8, pp=4), (), ["2 x pp = 8 stages", "7 pipeline layers", "--pp 3 or fewer"]),
])
def test_what_dualpipev_cannot_run_is_refused_at_check(tmp_path, cfg, args, said):
    cfg = {k: v for k, v in cfg.items() if v is not None}
    refused(check(tmp_path, cfg, *args), 1, "--schedule dualpipev", *said)
