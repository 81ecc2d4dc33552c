"""GPU memory a training rank holds outside torch's caching allocator: the CUDA context and NCCL's buffers.

Neither shows in torch.cuda.max_memory_allocated, both show in nvidia-smi, and neither grows with the model,
so the planner adds them as a fixed term per GPU (`fixed_bytes`), not as a share of the GPU. What stays
proportional is `dstk plan --reserve` (default 10%): the caching allocator's fragmentation (reserved but
unallocated blocks), which grows with what is allocated.

Figures, each an order of magnitude with its source (they vary with the driver, the CUDA and NCCL versions,
the GPU and the topology; measure yours with nvidia-smi beside torch.cuda.memory_reserved):
  CUDA_CONTEXT  512 MiB: torch's CUDA context with lazy module loading (CUDA_MODULE_LOADING=LAZY, torch's
                default since 1.13): 274 MiB measured in pytorch/pytorch#86509, 636 MiB without lazy loading;
                rounded up for the cuBLAS/cuDNN handles a training step loads with torch 2.x and CUDA 12
                (not measured here: this project's machines have no GPU).
  NCCL_COMM     512 MiB per NCCL communicator the rank uses: 544 MB for a 2-GPU and 688 MB for a 4-GPU
                communicator on 4 x A100 NVLink (NVIDIA/nccl#964, measured through torch); NCCL's memory is
                linear in its channel count, and H100's NVLink uses more channels (NVIDIA/nccl#864, #986:
                "we'll use more memory to reach H100 peak NVLink bandwidth"). NVLS (NVLink SHARP, H100/H200
                NVSwitch systems) adds more; NCCL_NVLS_ENABLE=0 saves it (NVIDIA NeMo launcher #127).
Communicators per rank (torch creates each lazily, at the first collective on its group; DeepSpeed passes
no device_id, so groups are not split from the world's and share no buffers):
  1 the world group (DeepSpeed's data-parallel all-reduce at pp = 1, dstk's loss and eval sums)
  + 1 the data-parallel group when it is not the world (dp > 1 beside pp or tp)
  + 3 with pp > 1: the pipeline group (the engine broadcasts the loss over it) and the (up to) two stages it
      sends to and receives from (torch opens one 2-rank communicator per send/recv pair)
  + 1 with tp > 1: the tensor-parallel group
  + 1 with ep > 1: the expert-parallel group (AutoEP's all-to-alls), + 1 the expert-data-parallel group when
      dp / ep > 1 (the experts' gradient reduction)
A world of one counts none: its one-rank communicator connects to no peer and allocates no channel buffers.
"""

from dataclasses import dataclass

MiB = 2**20
CUDA_CONTEXT = 512 * MiB
NCCL_COMM = 512 * MiB


@dataclass(frozen=True)
class Fixed:
    """Bytes per GPU outside torch's allocator."""

    cuda_context: int
    nccl: int
    communicators: int

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl


def communicators(pp: int, dp: int, tp: int, ep: int = 1) -> int:
    """NCCL communicators one rank of a pp x dp x tp layout (ep: of its dp ranks) opens (module docstring)."""
    world = pp * dp * tp
    if world == 1:
        return 0
    return 1 + (dp > 1 and pp * tp > 1) + 3 * (pp > 1) + (tp > 1) + (ep > 1) + (ep > 1 and dp > ep)


def fixed_bytes(pp: int, dp: int, tp: int = 1, ep: int = 1) -> Fixed:
    """The CUDA context and NCCL's buffers of one rank (module docstring)."""
    n = communicators(pp, dp, tp, ep)
    return Fixed(CUDA_CONTEXT, n * NCCL_COMM, n)
