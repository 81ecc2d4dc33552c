"""The planner's terms outside the layers: the loss's peak (once, on the head's stage), the logits a pipeline's
last stage keeps per micro-batch in flight, and the fixed bytes per GPU outside torch's allocator (the CUDA
context and NCCL's buffers, toolkit.plan.memory.overhead), shown by `dstk plan`."""

import re

import pytest

from toolkit.cli import main
from toolkit.plan.layouts.estimate import Layout
from toolkit.plan.gpus import MiB
from toolkit.plan.memory.overhead import CUDA_CONTEXT, NCCL_COMM, communicators, fixed_bytes
from toolkit.plan.layouts.planner import PlanRequest, estimate_layout

T, V = 4096, 128256  # llama-3.2-1b's vocabulary


def _estimate(tiled_loss="off", **layout):
    req = PlanRequest(model="llama-3.2-1b", gbs=16, gpus_per_node=8, gpu="h100-sxm", seq_len=T, tiled_loss=tiled_loss)
    return estimate_layout(req, Layout(**{"zero": 1, "mbs": 2, "gas": 8 // layout["dp"], **layout}))


@pytest.mark.parametrize("pp, dp, tp, comms", [(1, 1, 1, 0), (1, 8, 1, 1), (1, 4, 2, 3), (2, 4, 1, 5), (2, 2, 2, 6),
                                                (8, 1, 1, 4)])
def test_nccl_communicators_per_rank(pp, dp, tp, comms):
    """world + the dp group beside pp or tp + pipeline group and two send/recv peers + the tp group."""
    assert communicators(pp, dp, tp) == comms
    assert fixed_bytes(pp, dp, tp).total == CUDA_CONTEXT + comms * NCCL_COMM


def test_memory_is_what_torch_allocates_plus_the_fixed_bytes():
    e = _estimate(pp=1, dp=8)
    assert e.memory == e.allocated + 512 * MiB + 512 * MiB == e.states.peak + e.activations + 1024 * MiB
    assert e.fits == (e.memory <= e.capacity)


def test_the_loss_peak_is_counted_once_on_the_head_stage():
    """mbs 2 x 4096 tokens x 128k vocab: 12 bytes per token and vocabulary entry at the loss's peak (11.7 GiB),
    once, at pp 1 and on a pipeline's last stage (the logits that stage keeps per micro-batch in flight:
    tests/unit/test_tp_plan.py); the old head term was 4 bytes per micro-batch in flight."""
    alone, piped = _estimate(pp=1, dp=8), _estimate(pp=2, dp=4)
    assert alone.loss_peak == piped.loss_peak == 12 * 2 * T * V and piped.stage == 1
    assert alone.activations > alone.loss_peak


def test_a_tiled_loss_peaks_at_four_tiles_of_logits_and_its_pipeline_stage_holds_none():
    """dstk train's default (--tiled-loss auto: on at mbs 2 x 4096 tokens x 128k, 3.9 GiB of logits): the peak is four
    fp32 tiles of models.tiled.loss.tile_tokens(V) tokens and the bf16 (tokens, 2048) gradient of the hidden states
    (tests/unit/test_costs.py measures both); in a pipeline the head's stage no longer keeps each micro-batch's logits
    in flight, and stops being the heaviest."""
    from models.tiled.loss import tile_tokens

    whole, tiled = _estimate(pp=1, dp=8), _estimate(tiled_loss="auto", pp=1, dp=8)
    assert tiled.loss_peak == 16 * tile_tokens(V) * V + 2 * 2 * T * 2048 < whole.loss_peak
    assert whole.activations - tiled.activations == whole.loss_peak - tiled.loss_peak
    whole, tiled = _estimate(pp=2, dp=4), _estimate(tiled_loss="auto", pp=2, dp=4)
    assert whole.stage == 1 and tiled.stage == 0 and tiled.memory < whole.memory


def test_dstk_plan_shows_the_fixed_bytes_and_the_loss_peak(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-3.2-1b", "--gpus-per-node", "8", "--gpu", "h100-sxm", "--gbs", "16",
              "--seq-len", "4096", "--top", "1"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert "reserve for allocator fragmentation" in out and "loss peak" in out
    assert re.search(r"fixed [0-9.]+ GiB \(CUDA context 512 MiB, NCCL [1-9] x 512 MiB\)", out), out


def test_a_tiled_mlp_holds_no_blocks_intermediates_and_peaks_at_one_shard():
    """--tiled-mlp on: each of llama-3.2-1b's 16 blocks drops its MLP's 4 bf16 (tokens x 8192) tensors (64 KiB a
    token); the stage peaks once at one shard of 2048 tokens (the hidden size) and the (tokens, 2048) input gradient,
    less than the loss's peak here, so the whole 16 x 2 x 4096 x 64 KiB goes. auto leaves it off at 512 MiB a block."""
    def run(mode, **layout):
        req = PlanRequest(model="llama-3.2-1b", gbs=16, gpus_per_node=8, gpu="h100-sxm", seq_len=T, tiled_loss="off",
                          tiled_mlp=mode)
        return estimate_layout(req, Layout(**{"zero": 1, "mbs": 2, "gas": 8 // layout["dp"], **layout}))

    per_token = 2 * 4 * 8192
    whole, tiled, auto = run("off", pp=1, dp=8), run("on", pp=1, dp=8), run("auto", pp=1, dp=8)
    assert whole.activations - tiled.activations == 16 * 2 * T * per_token and auto.activations == whole.activations
    assert tiled.loss_peak == whole.loss_peak > 2048 * per_token + 2 * 2 * T * 2048
    # one more MLP forward per block in the step time: 3 matmuls of 2 x 2048 x 8192 FLOPs a token, 16 blocks
    extra = 16 * 3 * 2 * 2048 * 8192 * T
    per_sequence = sum(stage.flops for stage in whole.stages)
    assert tiled.times["compute"] / whole.times["compute"] == pytest.approx(1 + extra / per_sequence, rel=1e-9)
    piped_whole, piped = run("off", pp=2, dp=4), run("on", pp=2, dp=4)
    assert piped.memory < piped_whole.memory


def test_with_checkpointing_one_layer_is_recomputed_with_its_own_backward_transient():
    """Activation checkpointing at pp 1: each layer's input kept, the mask, and the larger of the block recomputed
    with its MLP's gradients and the head's input with the tiled loss's peak (the loss runs while no block is
    recomputed; the planner had added the loss's peak on top of the recomputed block)."""
    from toolkit.plan.arch import load_arch
    from toolkit.plan.cost.layers import layer_costs, logits_bytes, mask_bytes
    from toolkit.plan.layouts.long_sequences import tiled_loss_bytes

    arch = load_arch("llama-3.2-1b")
    req = PlanRequest(model="llama-3.2-1b", gbs=1, gpus_per_node=1, gpu="h100-sxm", seq_len=T, tiled_loss="on",
                      tiled_mlp="off")
    got = estimate_layout(req, Layout(pp=1, dp=1, zero=1, mbs=1, gas=1, checkpointing=True))
    costs = layer_costs(arch, T, 1, "bf16")
    block, head = costs[1], costs[-1]
    kept = len(costs) * 2 * T * arch.hidden
    recomputed = max(block.act_bytes + block.backward_bytes,
                     head.act_bytes - logits_bytes(arch, T, 1, 2) + tiled_loss_bytes(T, V, arch.hidden, 2))
    assert block.backward_bytes == 2 * 2 * T * 8192
    assert got.activations == kept + mask_bytes(T, 1, "bf16") + recomputed


@pytest.mark.parametrize("pp", [1, 2])
def test_offloaded_checkpoints_leave_two_on_the_gpu_and_the_rest_in_host_memory(pp):
    """--offload-activations (auto on a GPU from 1 GiB of a rank's checkpointed inputs): the checkpointed block
    inputs move to host memory but the newest and the one brought back for its recompute; counted against the
    host's memory, and said among the layout's long-sequence features."""
    from toolkit.plan.arch import load_arch
    from toolkit.plan.cost.layers import boundary_bytes
    from toolkit.plan.layouts.estimate import stage_flights

    arch, seq = load_arch("llama-3-8b"), 65536
    lay = Layout(pp=pp, dp=1, zero=1, mbs=1, gas=pp, checkpointing=True)
    plans = {mode: estimate_layout(PlanRequest(model="llama-3-8b", gbs=pp, gpus_per_node=pp, gpu="h100-sxm",
                                               seq_len=seq, offload_activations=mode), lay) for mode in ("off", "auto")}
    off, auto = plans["off"], plans["auto"]
    held = off.activations - auto.activations  # what left the heaviest stage's GPU
    layers = auto.parts[auto.stage + 1] - auto.parts[auto.stage]
    flight = stage_flights(lay, pp)[auto.stage]  # 1F1B's buffers: DeepSpeed keeps at least 2 in a pipeline
    assert held == auto.host_activations == (layers * flight - 2) * boundary_bytes(arch, seq, 1, "bf16")
    assert "checkpoints in host memory" in auto.features and "checkpoints in host memory" not in off.features
    assert off.host_activations == 0
