"""The streaming export on a real pipeline checkpoint: `dstk train` at pp = 2 under bf16 (2 CPU
processes, torchrun), then `dstk export` streams the layer files and BF16_Optimizer's fp32 masters
stage by stage into exactly the tensors the whole-model export writes; and the layer files DeepSpeed
wrote are the ones tests/unit/test_export_stream.py fabricates for its 200M-parameter RSS test."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_export_stream import fabricate_pipeline_checkpoint, read_weights

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "toolkit" / "corpus" / "corpus.txt"


def train(tmp: Path, pp: int, zero: int) -> Path:
    """tiny-gpt2 (tied embedding) on 2 processes (pp x dp = 2), bf16, 2 steps, no export."""
    from tests.conftest import child_env, free_port

    cfg = tmp / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "gradient_clipping": 0.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": zero},
                               "pipeline": {"stages": pp}, "steps_per_print": 10**6,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "toolkit.train", "--config", str(cfg), "--model", "tiny-gpt2", "--data", str(CORPUS),
           "--seq-len", "32", "--steps", "2", "--no-progress", "--eval-batches", "1", "--no-export",
           "--out", str(tmp / "run")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                            env=child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def bf16_pipeline_run(tmp_path_factory):
    """pp 2 x dp 1, ZeRO-1: layer files in bf16, BF16_Optimizer's fp32 masters per stage."""
    return train(tmp_path_factory.mktemp("pp2_bf16"), pp=2, zero=1)


@pytest.fixture(scope="module", params=[2, 3])
def bf16_zero_run(tmp_path_factory, request):
    """pp 1 x dp 2 at ZeRO 2 / 3: each rank's optimizer file holds its partition of the masters."""
    return train(tmp_path_factory.mktemp(f"dp2_zero{request.param}"), pp=1, zero=request.param)


def test_the_streamed_pipeline_export_is_the_whole_exports(bf16_pipeline_run, tmp_path):
    same_tensors_streamed_and_whole(bf16_pipeline_run, tmp_path)


def test_the_streamed_dp2_zero_export_is_the_whole_exports(bf16_zero_run, tmp_path):
    """The whole export gathers the partitions with DeepSpeed's zero_to_fp32; the stream, per tensor."""
    same_tensors_streamed_and_whole(bf16_zero_run, tmp_path)


def same_tensors_streamed_and_whole(run: Path, tmp_path: Path) -> None:
    import torch

    from toolkit.train.export import export

    for dtype in ("fp32", "bf16"):
        whole = read_weights(export(run, tmp_path / f"whole_{dtype}", dtype=dtype, stream=False))
        cli = subprocess.run([sys.executable, "-m", "toolkit.cli", "export", str(run),
                              str(tmp_path / f"streamed_{dtype}"), "--dtype", dtype, "--max-shard-size", "150KB"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert cli.returncode == 0, cli.stderr[-3000:]
        streamed = read_weights(tmp_path / f"streamed_{dtype}")
        assert whole.keys() == streamed.keys()
        assert all(torch.equal(whole[k], streamed[k]) and whole[k].dtype == streamed[k].dtype for k in whole)
    assert (tmp_path / "streamed_fp32" / "model.safetensors.index.json").is_file()
    w = read_weights(tmp_path / "streamed_fp32")["transformer.h.0.mlp.c_fc.weight"]
    assert (w.bfloat16().float() != w).float().mean() > 0.5  # the fp32 masters, not the bf16 layer files


def test_deepspeed_writes_the_layer_files_the_rss_test_fabricates(bf16_pipeline_run, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    meta = bf16_pipeline_run / "checkpoints" / "dstk"
    real_layout = json.loads((meta / "layout.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta))
    layout = fabricate_pipeline_checkpoint(model, AutoTokenizer.from_pretrained(meta), tmp_path / "ckpt", pp=2)
    assert {k: real_layout[k] for k in ("hf_names", "tied", "pp")} == {k: layout[k] for k in ("hf_names", "tied", "pp")}

    def layer_files(tag_dir):
        return {p.name: {k: tuple(v.shape) for k, v in torch.load(p).items()}
                for p in sorted(tag_dir.glob("layer_*-model_states.pt"))}

    tag = (bf16_pipeline_run / "checkpoints" / "latest").read_text().strip()
    assert layer_files(bf16_pipeline_run / "checkpoints" / tag) == layer_files(tmp_path / "ckpt" / "global_step1")
