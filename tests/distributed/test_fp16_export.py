"""fp16 pipelines export their fp32 masters, not the fp16-rounded weights (issue 31 item 8): at ZeRO-0 the
masters are FP16_UnfusedOptimizer's, in each stage's mp_rank file; at ZeRO-1 the optimizer's partition files
are zero_pp_rank_* (not bf16_zero_pp_rank_*). fp16 runs on this CPU through a stand-in for the GPU's fp16
support (scripts/fp16_stand_in.py)."""

import json
from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks
from tests.runs import REPO

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "fp16_stand_in.py"


@pytest.mark.parametrize("zero", [0, 1])
def test_an_fp16_pipeline_exports_its_fp32_masters(tmp_path, zero):
    from safetensors.torch import load_file

    from toolkit.checkpoint.state import load_state_dict

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": zero},
                               "pipeline": {"stages": 2}, "steps_per_print": 10**6,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}))
    out = tmp_path / "run"
    rc, log = run_ranks([SCRIPT, "--config", cfg, "--model", "tiny-llama", "--data", REPO / "toolkit" / "corpus" /
                         "corpus.txt", "--seq-len", "32", "--steps", "3", "--eval-fraction", "0", "--no-progress",
                         "--out", out], 2)
    assert rc == 0, log[-3000:]
    masters, _ = load_state_dict(out / "checkpoints")
    exported = {k: v for f in sorted((out / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        master, got = masters[name].reshape(-1), exported[name].float().reshape(-1)
        assert torch.equal(got, master), name  # the export carries the masters
        assert not torch.equal(master, master.half().float()), name  # which are off the fp16 grid
