"""The most memory a rank has held, and where the count starts: training's peak is counted from just before
its first step (reset_peaks, called by the step loop once the model and engine are built), so what loading
held (a checkpoint's tensors read, an fp32 copy cast) is not reported as training's; reset_peaks returns
that load-time peak, which the summary keeps beside it.

On CUDA: torch's allocator (torch.cuda.max_memory_allocated, reset by torch.cuda.reset_peak_memory_stats).
On the host: the resident set's high-water mark (Linux VmHWM, reset by writing 5 to /proc/self/clear_refs;
getrusage's ru_maxrss elsewhere, which nothing resets: there the host peak counts from the process start).
"""

import resource

CLEAR_REFS = "/proc/self/clear_refs"  # "5": reset this process's peak resident set to its current one


def host_peak_mib() -> float:
    """This process's peak resident set since it started or since the last reset, in MiB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def gpu_peak_mib(device) -> float | None:
    """What torch's allocator has handed out at most on `device` (a torch.device) since the last reset, in
    MiB; None off CUDA."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**20


def peak_memory_mib(device) -> float:
    """The peak a step record shows: GPU memory allocated on CUDA, else the host's resident set."""
    gpu = gpu_peak_mib(device)
    return host_peak_mib() if gpu is None else gpu


def reset_peaks(device) -> dict:
    """Start counting peaks afresh on this rank: {"host_mib", "gpu_mib" (None off CUDA), "host_reset"} as
    they stood before (the load's peaks), host_reset False where the host's peak cannot be reset (no
    /proc/self/clear_refs: it then still counts from the process start). The CUDA branch is torch's own
    call; the host branch runs wherever the tests do."""
    before = {"host_mib": round(host_peak_mib(), 1), "gpu_mib": gpu_peak_mib(device)}
    if before["gpu_mib"] is not None:
        import torch

        before["gpu_mib"] = round(before["gpu_mib"], 1)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        before["host_reset"] = True
    except OSError:
        before["host_reset"] = False
    return before
