"""What a pipeline stage holds when it goes to its device, by peak memory at build, measured on CPU.

DeepSpeed's PipelineModule moves a stage to its device as soon as its layers are built; the engine casts
the parameters to bf16 later, and dstk shards a stage's blocks over its tp group later still. On a GPU the
device then briefly held the stage whole, in the dtype it was built in: for a built-in model (a live fp32
model) 4 bytes x every parameter of the stage. On a CPU that move changes nothing, so the test counts what
it would carry: scripts/stage_moves.py records the stage's parameter bytes at every `nn.Module.to(device)`
on the PipelineModule (DeepSpeed's own, dstk's and the engine's), and the bytes the bf16 engine finally
trains. Every move must carry the final bytes (cast, sharded), no more.

Measured on tiny-llama, per rank: tp 2 over one stage (the whole model, 217,792 parameters): before, the
first move carried 871,168 bytes (fp32, unsharded), 3.47 x the 251,264 bf16 bytes of the rank's shard;
LoRA r 4 at pp 2 on a built-in model: 472,832 bytes (the frozen base in fp32), twice the final 236,416.
A saved directory already loads in bf16 (models.weights.loading.param_dtype), so there the unsharded stage was
the excess (435,584 bytes before, 251,264 now); it and the 4-process pp 2 x tp 2 layout are in the heavy tier.
"""

import json
from pathlib import Path

import pytest

from tests.distributed.launch import run_script

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "stage_moves.py"


def _launch(tmp_path: Path, nprocs: int, *pairs) -> dict:
    """{(case, i): [rank reports]} for the (case, model) pairs, built in one launch of `nprocs` ranks."""
    tmp_path.mkdir(exist_ok=True)
    run_script(SCRIPT, tmp_path, *[str(x) for pair in pairs for x in pair], num_procs=nprocs, timeout=240)
    return {(case, i): [json.loads((tmp_path / f"{case}-{i}-rank{r}.json").read_text()) for r in range(nprocs)]
            for i, (case, _) in enumerate(pairs)}


def _check(report: dict, sharded: bool) -> None:
    final, as_built = report["final_bytes"], report["stage_params_as_built"]
    assert report["final_dtypes"] == ["torch.bfloat16"]
    assert report["moves"] and all(m["bytes"] == final for m in report["moves"]), (report["moves"], final)
    assert final < 0.6 * 4 * as_built, (final, as_built)  # 4 * as_built: the fp32 stage as built, moved before
    if sharded:  # the blocks' projections are halved: under the unsharded stage's bf16 bytes
        assert final < 2 * as_built, (final, as_built)


def test_a_stage_goes_to_its_device_cast_and_sharded_not_whole_in_fp32(tmp_path):
    reports = _launch(tmp_path, 2, ("tp2", "tiny-llama"), ("lora-pp2", "tiny-llama"))
    for (case, _), ranks in reports.items():
        for report in ranks:
            _check(report, sharded=case == "tp2")


@pytest.mark.heavy
def test_a_saved_directory_and_a_3d_stage_go_to_their_device_as_tp_shards(tmp_path, saved_models):
    saved = saved_models.get("tiny-llama")  # fp32 safetensors, read per stage in bf16: the shard was the excess
    [ranks] = _launch(tmp_path / "dir", 2, ("tp2", saved)).values()
    [ranks_3d] = _launch(tmp_path / "3d", 4, ("pp2tp2", "tiny-llama")).values()
    for report in ranks + ranks_3d:
        _check(report, sharded=True)
