"""TF32 (`dstk train --tf32`, as HF Trainer's --tf32): fp32 matmuls and convolutions on the tensor cores of
NVIDIA Ampere and later GPUs (compute capability 8.0+), with a 10-bit mantissa instead of 23. torch leaves it
off for matmuls by default, so an fp32 run on an A100/H100 computes at the plain fp32 peak (67 TFLOPs on an
H100 SXM) where TF32 would give several times that; the opening block says so (`line`).

Where it cannot apply, --tf32 does nothing and says so, rather than refusing: a recipe holding `tf32: true`
runs unchanged on a CPU or an older GPU (a smoke test before the real run), and the numbers there are those
of plain fp32. Set through torch's legacy flags (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32),
which touch CUDA alone: the newer torch.backends.fp32_precision also switches oneDNN on the CPU, and once
any fp32_precision is set, torch >= 2.9 raises on every later read of the legacy flags
(torch.get_float32_matmul_precision included) as a mix of the two APIs.
"""

AMPERE = (8, 0)  # the first compute capability with TF32 tensor cores


def decide(asked: bool, device_type: str, capability: tuple | None, dtype: str, gpu: str | None) -> tuple:
    """(turn TF32 on, the opening block's line or None) for --tf32 `asked` on a `device_type` ("cuda" or
    "cpu") of compute `capability` (CUDA only) named `gpu`, in a run of `dtype` (fp32, bf16 or fp16)."""
    if device_type != "cuda":
        return False, ("--tf32: no effect on CPU (TF32 is a tensor-core format of NVIDIA GPUs, Ampere and later); "
                       "fp32 matmuls stay fp32") if asked else None
    if tuple(capability) < AMPERE:
        major, minor = capability
        return False, (f"--tf32: no effect on {gpu} (compute capability {major}.{minor}; TF32 needs 8.0, Ampere, "
                       "or later)") if asked else None
    if asked:
        low = "" if dtype == "fp32" else f" (this {dtype} run has few: its matmuls are {dtype})"
        return True, f"TF32: on (--tf32): fp32 matmuls and convolutions run on TF32 tensor cores{low}"
    if dtype != "fp32":
        return False, None
    return False, (f"TF32: off (torch's default): fp32 matmuls run at the plain fp32 peak on {gpu}; --tf32 runs them "
                   "on its TF32 tensor cores, several times faster with a 10-bit mantissa (HF Trainer's --tf32)")


def set_tf32(on: bool) -> None:
    """torch's switches for TF32 on CUDA: matmuls (cuBLAS) and cuDNN convolutions."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def apply(asked: bool, device, dtype: str) -> tuple:
    """decide() for this rank's `device` (a torch.device), turning TF32 on where it applies: (on, the line)."""
    capability = gpu = None
    if device.type == "cuda":
        import torch

        capability, gpu = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
    on, line = decide(asked, device.type, capability, dtype, gpu)
    if on:
        set_tf32(True)
    return on, line
