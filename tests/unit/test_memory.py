"""toolkit.plan.memory.rank: model-state bytes per ZeRO stage, 1F1B in-flight micro-batches, activations.
(The same formulas against real DeepSpeed engines: tests/distributed/test_memory_accuracy.py.)"""

import pytest

from toolkit.errors import ConfigError
from toolkit.plan.memory.rank import activation_bytes, in_flight, model_state_bytes

N = 1_000_000


def test_fp32_without_zero_is_16_bytes_per_parameter():
    s = model_state_bytes(N, dp=4, zero=0, precision="fp32")
    assert (s.params, s.grads, s.master, s.optimizer, s.buffers) == (4 * N, 4 * N, 0, 8 * N, 0)


def test_bf16_without_zero_keeps_full_fp32_master_and_states():
    s = model_state_bytes(N, dp=8, zero=0, precision="bf16")
    # bf16 weights, bf16 grads + the fp32 gradient copy at the step, fp32 master, Adam's two fp32 states
    assert (s.params, s.grads, s.master, s.optimizer) == (2 * N, 6 * N, 4 * N, 8 * N)


def test_bf16_pipeline_without_zero_partitions_master_like_deepspeed_bf16_optimizer():
    s = model_state_bytes(N, dp=4, zero=0, precision="bf16", pipeline=True)
    assert (s.master, s.optimizer) == (N, 2 * N)


@pytest.mark.parametrize("dp", [2, 8])
def test_each_zero_stage_shards_more(dp):
    peaks = [model_state_bytes(N, dp, z, "bf16", reduce_bucket_size=0).peak for z in range(4)]
    # ZeRO-1 and -2 can tie: at the step both hold the fp32 gradient partition next to the bf16 one
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[1] and peaks[2] > peaks[3]
    z3 = model_state_bytes(N, dp, 3, "bf16", reduce_bucket_size=0)
    assert z3.params == 2 * N // dp and z3.master == 4 * N // dp and z3.optimizer == 8 * N // dp


def test_zero1_holds_full_gradients_until_the_boundary_zero2_does_not():
    z1 = model_state_bytes(N, 4, 1, "fp32", reduce_bucket_size=1000)
    z2 = model_state_bytes(N, 4, 2, "fp32", reduce_bucket_size=1000)
    # ZeRO-1 at the boundary: the full accumulated gradients and the partition being filled (N / dp)
    assert z1.grads == 4 * N + 4 * N // 4 and z2.grads == N and z1.buffers == z2.buffers == 4000
    offloaded = model_state_bytes(N, 4, 1, "fp32", offload="optimizer", reduce_bucket_size=1000)
    assert offloaded.grads == 4 * N  # offload copies reduced gradients to host buffers instead


FROZEN = 9 * N  # a LoRA-like stage: 9 frozen parameters per trainable one


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_parameters_cost_their_weights_only(zero, precision):
    full = model_state_bytes(N, 2, zero, precision)
    assert model_state_bytes(N, 2, zero, precision, trainable=N) == full  # all trainable: as before
    lora = model_state_bytes(N + FROZEN, 2, zero, precision, trainable=N)
    w = 4 if precision == "fp32" else 2
    held = FROZEN // 2 if zero == 3 else FROZEN  # ZeRO-3 partitions frozen weights too
    assert lora.params - full.params == held * w
    assert (lora.grads, lora.master, lora.optimizer, lora.buffers) == (full.grads, full.master, full.optimizer,
                                                                        full.buffers)


def test_a_frozen_base_is_far_below_training_everything():
    everything = model_state_bytes(N + FROZEN, 1, 0, "bf16").peak  # 2 + 6 + 4 + 8 bytes per parameter
    lora = model_state_bytes(N + FROZEN, 1, 0, "bf16", trainable=N // 100)
    assert everything == 20 * (N + FROZEN)
    assert lora.peak == 2 * (N + FROZEN) + 18 * (N // 100) and lora.peak < 0.11 * everything


def test_a_stage_with_nothing_to_train_holds_weights_only():
    s = model_state_bytes(N, 2, 1, "bf16", trainable=0)
    assert (s.params, s.grads, s.master, s.optimizer, s.buffers) == (2 * N, 0, 0, 0, 0)


@pytest.mark.parametrize("trainable", [-1, N + 1, 1.5, True])
def test_trainable_outside_the_parameters_is_refused(trainable):
    with pytest.raises(ConfigError, match=r"trainable must be an integer in \[0, num_params"):
        model_state_bytes(N, 1, 0, trainable=trainable)


def test_sgd_keeps_one_state():
    assert model_state_bytes(N, 1, 0, "fp32", optimizer="sgd").optimizer == 4 * N


def test_offload_moves_master_and_states_to_host():
    on_gpu = model_state_bytes(N, 2, 2, "bf16", reduce_bucket_size=0)
    off = model_state_bytes(N, 2, 2, "bf16", offload="optimizer", reduce_bucket_size=0)
    assert off.master == off.optimizer == 0 and off.params == on_gpu.params
    assert off.cpu == on_gpu.master + on_gpu.optimizer + 4 * N // 2
    everything = model_state_bytes(N, 2, 3, "bf16", offload="all", reduce_bucket_size=0)
    assert everything.params == 0 and everything.cpu > off.cpu


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_params=0, dp=1, zero=0), "num_params"), (dict(num_params=N, dp=0, zero=0), "dp"),
    (dict(num_params=N, dp=1, zero=4), "ZeRO stage"), (dict(num_params=N, dp=1, zero=0, precision="int8"), "int8"),
    (dict(num_params=N, dp=1, zero=0, offload="optimizer"), "ZeRO >= 1"),
    (dict(num_params=N, dp=1, zero=2, offload="all"), "ZeRO-3")])
def test_bad_input_is_a_config_error(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        model_state_bytes(**kwargs)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 8), (4, 3), (4, 16), (8, 4)])
def test_in_flight_is_deepspeed_num_pipe_buffers(pp, m):
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    for stage in range(pp):
        assert in_flight(pp, m, stage) == TrainSchedule(m, pp, stage).num_pipe_buffers()


def test_activations_times_in_flight_and_checkpointing():
    per_layer, parts = [10, 100, 100, 100, 100, 50], [0, 3, 6]
    assert activation_bytes(per_layer, parts, pp=2, micro_batches=8) == [210 * 2, 250 * 2]
    assert activation_bytes(per_layer, [0, 6], pp=1, micro_batches=8) == [460]
    inputs = [1] * 6  # checkpointing keeps each layer's input per micro-batch, recomputes one layer
    assert activation_bytes(per_layer, parts, 2, 8, checkpoint_bytes=inputs) == [3 * 2 + 100, 3 * 2 + 100]


def test_overlap_comm_double_buffers_the_zero2_bucket():
    bucket = N  # elements: large enough that the end of backward is the peak moment
    single = model_state_bytes(N, 4, 2, "bf16", reduce_bucket_size=bucket)
    double = model_state_bytes(N, 4, 2, "bf16", reduce_bucket_size=bucket, overlap_comm=True)
    assert double.buffers == 2 * single.buffers == 2 * bucket * 2
    assert double.peak - single.peak == bucket * 2


def test_bf16_with_fp32_gradient_accumulation_holds_a_full_fp32_gradient_buffer():
    """generate-config's bf16 default (ZeRO-1, data_types.grad_accum_dtype fp32) runs DeepSpeed's BF16_Optimizer:
    every rank sums gradients into a full fp32 buffer (4 bytes per parameter, not partitioned) beside the bf16
    gradients; masters and Adam states are partitioned; no reduction buckets."""
    plain = model_state_bytes(N, dp=8, zero=1, precision="bf16")
    s = model_state_bytes(N, dp=8, zero=1, precision="bf16", fp32_grad_accum=True)
    assert s.grads == (4 + 2) * N and s.buffers == 0  # the fp32 buffer and the bf16 gradients until the step
    assert s.master == plain.master == N // 8 * 4 and s.optimizer == plain.optimizer
    assert s.peak - plain.peak >= 4 * N - plain.grads - plain.buffers
