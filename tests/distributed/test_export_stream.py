"""The streaming export on a real pipeline checkpoint: `dstk train` at pp = 2 under bf16 (2 CPU
processes, torchrun; tiny-gpt2, 2 steps: the session's `bf16_runs`, tests/distributed/conftest.py),
then `dstk export` streams the layer files and BF16_Optimizer's fp32 masters stage by stage into
exactly the tensors the whole-model export writes; and the layer files DeepSpeed wrote are the ones
tests/unit/test_export_stream.py fabricates for its 200M-parameter RSS test."""

import json
from pathlib import Path

import pytest

from tests.unit.test_export_stream import fabricate_pipeline_checkpoint, read_weights

pytestmark = pytest.mark.distributed

@pytest.fixture(scope="module")
def bf16_pipeline_run(bf16_runs):
    """pp 2 x dp 1, ZeRO-1: layer files in bf16, BF16_Optimizer's fp32 masters per stage (the run
    test_pipeline_training's bf16 export test reads too)."""
    return bf16_runs.get("tiny-gpt2", pp=2, zero=1)


@pytest.fixture(scope="module", params=[2, 3])
def bf16_zero_run(bf16_runs, request):
    """pp 1 x dp 2 at ZeRO 2 / 3: each rank's optimizer file holds its partition of the masters."""
    return bf16_runs.get("tiny-gpt2", pp=1, zero=request.param, export=False)


def test_the_streamed_pipeline_export_is_the_whole_exports(bf16_pipeline_run, tmp_path):
    same_tensors_streamed_and_whole(bf16_pipeline_run, tmp_path)


def test_the_streamed_dp2_zero_export_is_the_whole_exports(bf16_zero_run, tmp_path):
    """The whole export gathers the partitions with DeepSpeed's zero_to_fp32; the stream, per tensor."""
    same_tensors_streamed_and_whole(bf16_zero_run, tmp_path)


def same_tensors_streamed_and_whole(run: Path, tmp_path: Path) -> None:
    """`dstk export` (its console entry point, in this process: no interpreter start-up per call)."""
    import torch

    from toolkit.cli import main
    from toolkit.export.directory import export

    for dtype in ("fp32", "bf16"):
        whole = read_weights(export(run, tmp_path / f"whole_{dtype}", dtype=dtype, stream=False))
        with pytest.raises(SystemExit) as cli:
            main(["export", str(run), str(tmp_path / f"streamed_{dtype}"), "--dtype", dtype,
                  "--max-shard-size", "150KB"])
        assert cli.value.code == 0  # its error, if any, is in the captured stderr
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
    real_layout = json.loads((meta / "manifest.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta))
    layout = fabricate_pipeline_checkpoint(model, AutoTokenizer.from_pretrained(meta), tmp_path / "ckpt", pp=2)
    assert {k: real_layout[k] for k in ("hf_names", "tied", "pp")} == {k: layout[k] for k in ("hf_names", "tied", "pp")}

    def layer_files(tag_dir):
        return {p.name: {k: tuple(v.shape) for k, v in torch.load(p).items()}
                for p in sorted(tag_dir.glob("layer_*-model_states.pt"))}

    tag = (bf16_pipeline_run / "checkpoints" / "latest").read_text().strip()
    assert layer_files(bf16_pipeline_run / "checkpoints" / tag) == layer_files(tmp_path / "ckpt" / "global_step1")
