"""Checkpointed activations to host memory (models.tiled.offload, dstk train --offload-activations): DeepSpeed's
offload engines with CPU tensors copied (on this CPU machine the host copy stands in for a GPU's trip to pinned
memory: same code path, no side stream). HF gradient checkpointing under host_offload gives the same loss and
gradients with every block's input but the newest moved and brought back; deepspeed.checkpointing with
cpu_checkpointing (the pipeline's path, for_pipeline) likewise, where DeepSpeed's own CPU path would empty the
checkpoints; the choice auto / on / off."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from models.tiled import offload
from tests.unit.test_tiled_loss import assert_same, batch, grads
from toolkit.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from arch_sweep_config import build_tiny  # noqa: E402

GiB = 2**30


def step(model, ids, labels, context=None) -> float:
    with context or torch.enable_grad():
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
    return loss.item()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_hf_checkpoints_go_to_the_host_and_back_unchanged(kind):
    model = build_tiny(kind)
    model = (model[0] if isinstance(model, tuple) else model).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moved = copy.deepcopy(model)
    ids, labels = batch(model.config)
    context = offload.host_offload()
    assert step(moved, ids, labels, context) == pytest.approx(step(model, ids, labels), rel=1e-6)
    assert_same(grads(model), grads(moved))
    blocks = model.config.num_hidden_layers
    stats = context.stats
    assert stats.marked_tensors == blocks  # each block's hidden-state input, nothing else
    assert stats.offloaded_tensors == blocks - 1 and stats.kept_last_tensors == 1  # the newest stays for the backward
    assert stats.restored_tensors == blocks - 1
    assert stats.offloaded_bytes == (blocks - 1) * ids.numel() * model.config.hidden_size * 4


def test_around_micro_batch_follows_the_models_choice():
    model = torch.nn.Linear(2, 2)
    assert not hasattr(offload.around_micro_batch(model), "stats")
    model.dstk_offload_activations = (False, "off")
    assert not hasattr(offload.around_micro_batch(model), "stats")
    model.dstk_offload_activations = (True, "on")
    assert hasattr(offload.around_micro_batch(model), "stats")


class Blocks(torch.nn.Module):
    """Three blocks, each checkpointed by deepspeed.checkpointing as a pipeline stage's layers are."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        from deepspeed import checkpointing

        for block in self.blocks:
            x = checkpointing.checkpoint(lambda h, b=block: torch.tanh(b(h)) + h, x)
        return x.square().mean()


@pytest.fixture
def cpu_checkpointing(ds_world1):  # deepspeed.checkpointing.configure logs on rank 0 of deepspeed.comm
    from deepspeed.runtime.activation_checkpointing import checkpointing

    yield checkpointing
    offload.for_pipeline(False)
    assert not checkpointing.CPU_CHECKPOINT and checkpointing._get_cpu_offload_engine() is None


def test_the_pipelines_checkpoints_go_to_the_host_and_back_unchanged(cpu_checkpointing):
    plain, moved = Blocks(), Blocks()
    x = torch.randn(4, 16, requires_grad=True)
    offload.for_pipeline(False)
    plain(x.clone()).backward()
    offload.for_pipeline(True)
    assert cpu_checkpointing.CPU_CHECKPOINT
    h = x.clone()
    moved(h).backward()
    assert_same(grads(plain), grads(moved), rel=1e-6)
    stats = cpu_checkpointing._get_cpu_offload_engine().stats
    assert stats.offloaded_tensors == 2 and stats.kept_last_tensors == 1 and stats.restored_tensors == 2
    assert h.numel() == 64  # the first block's input, emptied while offloaded, holds its values again


def test_deepspeeds_own_cpu_path_is_why_the_engine_is_given_the_copying(cpu_checkpointing):
    """On a CPU accelerator DeepSpeed's blocking cpu_checkpointing "copies" a CPU tensor to the CPU (the same
    tensor), then empties it: the recompute gets a 0-d input. If this ever passes, for_pipeline's engine can go."""
    from deepspeed import checkpointing

    checkpointing.configure(None, checkpoint_in_cpu=True)
    cpu_checkpointing._get_cpu_offload_engine = lambda: None
    with pytest.raises(RuntimeError, match="0D|Mismatch in shape"):  # its input a 0-d tensor
        Blocks()(torch.randn(4, 16, requires_grad=True)).backward()


def test_auto_offloads_from_a_gpu_past_one_gib_and_never_on_a_cpu():
    held = offload.checkpoint_bytes(131072, 4096, 32, 2)  # Llama-3-8B at 128K tokens in bf16
    assert held == 32 * GiB
    on, why = offload.choose("auto", held, True, "cuda")
    assert on and "32.00 GiB" in why and "at least 1 GiB" in why
    assert not offload.choose("auto", GiB // 2, True, "cuda")[0]
    on, why = offload.choose("auto", held, True, "cpu")
    assert not on and "host memory" in why
    on, why = offload.choose("on", held, True, "cpu")
    assert on and "nothing saved" in why
    assert offload.choose("off", held, True, "cuda") == (False, "--offload-activations off; checkpointed block "
                                                                "inputs 32.00 GiB per micro-batch")


def test_without_checkpointing_there_is_nothing_to_offload():
    on, why = offload.choose("auto", 32 * GiB, False, "cuda")
    assert not on and "activation_checkpointing" in why
    with pytest.raises(ConfigError, match="--offload-activations on: no activation checkpointing"):
        offload.choose("on", 32 * GiB, False, "cuda")


def test_every_stage_decides_on_its_share_of_the_blocks():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32)
    assert offload.decide("auto", config, 4096, 1, 2, True, "cuda")[1].startswith(
        "checkpointed block inputs 1.00 GiB")
    assert not offload.decide("auto", config, 4096, 4, 2, True, "cuda")[0]  # 8 blocks a stage: 0.25 GiB


def test_train_check_refuses_on_without_checkpoints_before_any_rank_starts():
    from toolkit.train.runner import check_offload

    with pytest.raises(ConfigError, match="--offload-activations on: no activation checkpointing"):
        check_offload("on", {}, 1)
    with pytest.raises(ConfigError, match="pipeline.activation_checkpoint_interval"):
        check_offload("on", {"activation_checkpointing": {}, "pipeline": {"stages": 2}}, 2)
    check_offload("on", {"activation_checkpointing": {}}, 1)
    check_offload("on", {"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}, 2)
    check_offload("auto", {}, 1)
