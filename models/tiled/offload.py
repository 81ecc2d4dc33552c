"""Checkpointed activations in host memory (dstk train --offload-activations): with activation checkpointing a
model keeps, for its backward, each checkpointed block's input, a (tokens, hidden) tensor per block and
micro-batch in flight (Llama-3-8B at 131072 tokens in bf16: 1 GiB per block, 32 GiB for its 32 blocks). With this
on, those inputs go to host memory as the forward passes each block and come back for the block's recompute in the
backward, so the device holds about one of them at a time. DeepSpeed's pieces do the copying:

- pp = 1 (HF gradient checkpointing, non-reentrant): DeepSpeed's CheckpointHiddenStatesOffload, a
  saved_tensors_hooks context around each micro-batch's forward and backward (`around_micro_batch`) that offloads
  only the hidden states HF's GradientCheckpointingLayer checkpoints, on a side stream into pinned buffers, keeping
  the newest on the device (the first backward needs it at once);
- pipeline stages (DeepSpeed's reentrant deepspeed.checkpointing of each checkpointed layer): its
  `cpu_checkpointing`, the same engine driven by checkpointing.py (`for_pipeline`).

On a CPU the tensors already live in host memory: DeepSpeed then copies them within it (blocking copies, its
cpu_checkpointing's path on a CPU accelerator), which saves nothing; CheckpointHiddenStatesOffload would skip
them, so `HostOffload` copies them likewise, the same path a GPU takes without its streams. auto leaves it off
there, and `on` says so in the opening lines.
"""

import contextlib

from models.tiled import choose_mode, size_words

AUTO_BYTES = 2**30  # --offload-activations auto: on from 1 GiB of checkpointed block inputs on a GPU (Llama-3-8B in
# bf16: 4096 tokens per micro-batch); below it the device memory saved is small next to the host copies' traffic
NO_CHECKPOINTS = ("no activation checkpointing to offload (the DeepSpeed config's activation_checkpointing section; a "
                  "pipeline's pipeline.activation_checkpoint_interval)")


def checkpoint_bytes(tokens: int, hidden: int, blocks: int, dtype_bytes: int) -> int:
    """The checkpointed blocks' inputs a rank keeps for one micro-batch of `tokens` tokens: (tokens, hidden) each."""
    return tokens * hidden * dtype_bytes * blocks


def choose(mode: str, held: int, checkpointing: bool, device: str, blocker: str | None = None) -> tuple:
    """(on, why) for --offload-activations `mode` (auto, on, off) on a rank whose checkpointed block inputs take
    `held` bytes per micro-batch, on `device` ("cuda", "cpu"): off without activation checkpointing (there is
    nothing checkpointed to move), and on a CPU unless asked for (host memory is the device's)."""
    if not checkpointing and blocker is None:
        blocker = NO_CHECKPOINTS
    size = f"checkpointed block inputs {size_words(held)} per micro-batch"
    if device == "cpu" and blocker is None:
        if mode == "auto":
            return False, f"{size}; on a CPU they already live in host memory; --offload-activations on to copy anyway"
        if mode == "on":
            return True, f"--offload-activations on; {size}, copied within host memory on a CPU: nothing saved"
    return choose_mode("--offload-activations", mode, held, size, blocker, AUTO_BYTES)


def decide(mode: str, config, tokens: int, stages: int, dtype_bytes: int, checkpointing: bool, device: str) -> tuple:
    """choose() for a rank of a `stages`-stage layout (pp = 1: one) holding its share of the HF `config`'s blocks, of
    `tokens` tokens per micro-batch (mbs x seq_len / sp) in `dtype_bytes`: every rank of a layout answers the same."""
    text = config.get_text_config()
    blocks = -(-text.num_hidden_layers // stages)
    return choose(mode, checkpoint_bytes(tokens, text.hidden_size, blocks, dtype_bytes), checkpointing, device)


def copies_on_cpu(engine_class):
    """`engine_class` (one of DeepSpeed's activation offload engines) made to copy CPU tensors too: DeepSpeed skips
    every tensor on a CPU accelerator; here one is copied within host memory, the path a GPU's takes without its
    side stream (module docstring)."""
    import torch

    class CopiesOnCpu(engine_class):
        def _should_skip(self, tensor) -> bool:
            if tensor.device.type != "cpu":
                return super()._should_skip(tensor)
            return (tensor.nbytes < self.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                    or (tensor.numel() > 1 and 0 in tensor.stride()))

    return CopiesOnCpu


def host_offload():
    """DeepSpeed's CheckpointHiddenStatesOffload for one micro-batch's forward and backward (CPU tensors copied
    too)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    return copies_on_cpu(CheckpointHiddenStatesOffload)()


def around_micro_batch(module):
    """The context a pp = 1 micro-batch's forward and backward run in: host_offload() when the model was set up
    with the offload on (`module.dstk_offload_activations`, (on, why)), else nothing."""
    if not (getattr(module, "dstk_offload_activations", None) or (False,))[0]:
        return contextlib.nullcontext()
    return host_offload()


def for_pipeline(on: bool) -> None:
    """deepspeed.checkpointing's cpu_checkpointing, which the pipeline's checkpointed layers go through, set to
    `on` (process-wide: set at every pipeline's build, so one run's setting never reaches the next). On a CPU
    accelerator DeepSpeed would take its blocking path, whose copy to the host is no copy there (`.to("cpu")` of a
    CPU tensor returns it), so it empties the checkpoints it meant to keep (the recompute then runs on a 0-d
    tensor); there its offload engine, the one a GPU uses, is given the copying instead (`copies_on_cpu`)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.activation_checkpointing.offload_activations import _ActivationOffloadEngine

    checkpointing.configure(None, checkpoint_in_cpu=on)
    if not get_accelerator().is_synchronized_device():
        return
    engine = copies_on_cpu(_ActivationOffloadEngine)(keep_last_count=1, min_offload_bytes=0) if on else None
    checkpointing._cpu_offload_engine = engine  # what _reset_cpu_offload_engine resets after each forward
    checkpointing._get_cpu_offload_engine = lambda: engine  # read once per checkpointed layer's forward
