"""What a run reports is its steady state: tokens/s and MFU over the steps after the first (the warm-up), and
peak memory counted from just before the first step, the load's peak beside it (toolkit.train.report.memory);
and --tf32 (toolkit.train.tf32): said in the opening block, applied where TF32 exists, a no-op that says so on a
CPU or an older GPU.

The runs are real (toolkit.train.runner.run in this process's world of one, tests/conftest.py ds_world1). The
CUDA branches are torch's own calls (torch.cuda.reset_peak_memory_stats, the device's capability): this
machine has no GPU, so the host branch of the memory reset is exercised for real, and TF32's decision is
tested for a CUDA device by its capability, with the flags it sets read back from torch.
"""

import json

import pytest
import torch

from tests.unit.test_train_refusals import _args, train_cli
from toolkit.train import tf32
from toolkit.train.report import memory
from toolkit.train.report.summary import throughput

BALLOON = 512 * 2**20  # bytes touched and freed while the engine is built: a load-time peak


def _balloon() -> None:
    """BALLOON bytes touched, then freed and handed back to the system: mmap'd, or heap that malloc_trim returns
    (after a long suite the process holds freed heap that a 512 MiB block may reuse, and keep resident)."""
    _trim()
    torch.ones(BALLOON // 4, dtype=torch.float32).sum()
    _trim()


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc: free heap back to the system
    except (OSError, AttributeError):
        pass  # another C library: nothing to trim


def test_throughput_leaves_out_the_first_step():
    # 1000 tokens (4 rows) a step: a slow first step, then 2 s and 0.5 s
    got = throughput([10.0, 2.0, 0.5], 1000, 4)
    assert got == {"tokens_per_s": 800.0, "samples_per_s": 3.2, "timed_steps": 2, "warmup_steps": 1}
    assert throughput([4.0], 1000, 4) == {"tokens_per_s": 250.0, "samples_per_s": 1.0, "timed_steps": 1,
                                          "warmup_steps": 0}  # one step: nothing else to time


def test_reset_peaks_forgets_what_was_held_before_on_the_host():
    cpu = torch.device("cpu")
    _balloon()
    before = memory.reset_peaks(cpu)
    after = memory.host_peak_mib()
    assert before["host_reset"] and before["gpu_mib"] is None
    assert after < before["host_mib"] - 0.75 * BALLOON / 2**20, (before, after)
    assert memory.peak_memory_mib(cpu) == pytest.approx(memory.host_peak_mib(), abs=64)


def test_a_run_counts_its_peak_from_the_built_engine_and_its_rate_from_step_2(ds_world1, tmp_path, monkeypatch,
                                                                               capsys):
    """The engine is built (a 512 MiB transient then), the peaks are reset, then step 1 runs: the summary's
    peak host memory leaves the transient out and its load_peak keeps it; the summary's tokens/s is steps
    2-3's (their tokens over their seconds in metrics.jsonl), not an average with step 1. On CPU --tf32 is
    a no-op that the opening block states, and torch's flag stays off."""
    from toolkit.train import job, loop
    from toolkit.train.runner import run

    calls = []

    def spy(name, real, after=None):
        def called(*args, **kwargs):
            calls.append(name)
            out = real(*args, **kwargs)
            if after:
                after()
            return out

        return called

    monkeypatch.setattr(job, "start_engine", spy("engine", job.start_engine, after=_balloon))
    monkeypatch.setattr(memory, "reset_peaks", spy("reset", memory.reset_peaks))
    monkeypatch.setattr(loop, "train_step", spy("step", loop.train_step))
    summary = run(_args(tmp_path, steps=3, tf32=True, eval_fraction=0.0))
    assert calls == ["engine", "reset", "step", "step", "step"]
    load, train = summary["load_peak_rss_mib_per_rank"][0], summary["peak_rss_mib_per_rank"][0]
    assert train < load - 0.75 * BALLOON / 2**20, (load, train)
    assert summary["load_peak_gpu_mib_per_rank"] == summary["peak_gpu_mib_per_rank"] == [None]  # no CUDA

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "step" in r]
    assert (summary["timed_steps"], summary["warmup_steps"]) == (2, 1)
    assert summary["tokens_per_s"] == pytest.approx(2 / (1 / rates[1] + 1 / rates[2]), rel=1e-9)
    assert records[-1]["summary"]["tokens_per_s"] == summary["tokens_per_s"]

    head = capsys.readouterr().out
    assert "--tf32: no effect on CPU (TF32 is a tensor-core format of NVIDIA GPUs, Ampere and later)" in head
    assert head.index("layout: ") < head.index("--tf32: no effect") < head.index("training: all")
    assert torch.backends.cuda.matmul.allow_tf32 is False


@pytest.mark.parametrize("asked, device, capability, dtype, on, words", [
    (False, "cuda", (9, 0), "fp32", False, "TF32: off (torch's default): fp32 matmuls run at the plain fp32 peak on "
                                           "GPU; --tf32 runs them on its TF32 tensor cores"),
    (True, "cuda", (8, 0), "fp32", True, "TF32: on (--tf32): fp32 matmuls and convolutions run on TF32 tensor cores"),
    (True, "cuda", (9, 0), "bf16", True, "(this bf16 run has few: its matmuls are bf16)"),
    (False, "cuda", (9, 0), "bf16", False, None),  # nothing to say: its matmuls are bf16
    (True, "cuda", (7, 0), "fp32", False, "--tf32: no effect on GPU (compute capability 7.0; TF32 needs 8.0"),
    (False, "cuda", (7, 5), "fp32", False, None),  # no TF32 to offer
    (True, "cpu", None, "fp32", False, "--tf32: no effect on CPU"),
    (False, "cpu", None, "fp32", False, None),
])
def test_what_the_opening_block_says_about_tf32(asked, device, capability, dtype, on, words):
    got_on, line = tf32.decide(asked, device, capability, dtype, "GPU")
    assert got_on is on
    assert (line is None) if words is None else (words in line), line


def test_set_tf32_turns_on_torchs_cuda_flags_and_nothing_on_the_cpu():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    cpu = torch.backends.mkldnn.matmul.fp32_precision if hasattr(torch.backends.mkldnn, "matmul") else None
    try:
        tf32.set_tf32(False)
        assert torch.get_float32_matmul_precision() == "highest"
        tf32.set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"  # the legacy and new getters both still answer
        if cpu is not None:
            assert torch.backends.mkldnn.matmul.fp32_precision == cpu  # oneDNN's CPU matmuls untouched
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_passes_check_and_is_a_recipe_key(tmp_path):
    ok = train_cli(tmp_path, "--tf32", "--check")
    assert ok.returncode == 0 and ok.stdout.startswith("ok: "), ok.stderr[-2000:]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("tf32: true\n")
    assert train_cli(tmp_path, "--recipe", str(recipe), "--check").returncode == 0
    recipe.write_text("tf32: sometimes\n")
    bad = train_cli(tmp_path, "--recipe", str(recipe), "--check")
    assert bad.returncode != 0 and "tf32" in bad.stderr and "true or false" in bad.stderr, bad.stderr[-2000:]
