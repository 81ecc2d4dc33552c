"""GPU presets for `dstk plan`: memory, dense peak throughput and link bandwidths, and memory sizes
written as text ("80GiB", "24GB").

Figures are the vendors' datasheet numbers (the datasheet is named on each row): dense (no sparsity)
tensor-core TFLOPs, i.e. half the "with sparsity" figure the datasheets print first; memory as
`nvidia-smi` reports it (MiB); bandwidths in GB/s per GPU per direction: `nvlink` between GPUs of
one node (PCIe when the card has no NVLink), `network` per GPU between nodes (a typical InfiniBand /
EFA share for that generation), `pcie` between GPU and host (used by offload). They are defaults;
`dstk plan --tflops/--intra-bw/--inter-bw` override them. The same table gives the peak that MFU is
measured against (toolkit.plan.cost.mfu), with the CUDA device name matched by `preset_for_device`.
"""

import difflib
import math
import re
from dataclasses import dataclass, replace

from toolkit.errors import ConfigError

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes
    bf16_tflops: float | None  # dense peak; None where the chip has no bf16 tensor cores
    fp16_tflops: float
    fp32_tflops: float  # plain fp32 (no TF32): what an fp32 run gets by default in torch
    nvlink: float  # GB/s per direction between GPUs of one node
    network: float  # GB/s per GPU per direction between nodes
    pcie: float = 25.0  # GB/s per direction GPU <-> host

    def tflops(self, precision: str) -> float:
        """Dense peak TFLOPs for `precision`; a clear error where the chip lacks it."""
        value = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.fp32_tflops}[precision]
        if value is None:
            raise ConfigError(f"{self.name} has no {precision} tensor cores; use --precision fp16 "
                              f"(or give --tflops to plan anyway)")
        return value


GPUS = {g.name: g for g in [
    # NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 312 (624 sparse), FP32 19.5
    Gpu("a100-40gb", 40960 * MiB, 312, 312, 19.5, nvlink=300, network=25, pcie=25),
    Gpu("a100-80gb", 81920 * MiB, 312, 312, 19.5, nvlink=300, network=25, pcie=25),
    Gpu("a100-pcie-80gb", 81920 * MiB, 312, 312, 19.5, nvlink=25, network=25, pcie=25),
    # NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 SXM 989, PCIe 756, NVL 835 (1,979 / 1,513 / 1,671
    # sparse); FP32 67 / 51 / 60; NVL: 94 GB, NVLink bridge 600 GB/s both ways
    Gpu("h100-sxm", 81559 * MiB, 989, 989, 67, nvlink=450, network=50, pcie=50),
    Gpu("h100-pcie", 81559 * MiB, 756, 756, 51, nvlink=50, network=25, pcie=50),
    Gpu("h100-nvl", 95830 * MiB, 835, 835, 60, nvlink=300, network=50, pcie=50),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16/FP16 989 (1,979 sparse), FP32 67, 141 GB
    Gpu("h200", 143771 * MiB, 989, 989, 67, nvlink=450, network=50, pcie=50),
    # NVIDIA L40S datasheet: BF16/FP16 362 (733 sparse), FP32 91.6, 48 GB GDDR6, PCIe Gen4, no NVLink
    Gpu("l40s", 46068 * MiB, 362, 362, 91.6, nvlink=25, network=12.5, pcie=25),
    # NVIDIA L4 datasheet: BF16/FP16 121 (242 sparse), FP32 30.3
    Gpu("l4", 23034 * MiB, 121, 121, 30.3, nvlink=25, network=12.5, pcie=25),
    # A10G (AWS G5 instances): no NVIDIA datasheet; BF16/FP16 70 dense and FP32 31.2 as commonly cited
    Gpu("a10g", 23028 * MiB, 70, 70, 31.2, nvlink=25, network=12.5, pcie=25),
    # NVIDIA V100 datasheet: no bf16; FP16 tensor 125, FP32 15.7 (SXM2)
    Gpu("v100-16gb", 16384 * MiB, None, 125, 15.7, nvlink=150, network=12.5, pcie=12.5),
    Gpu("v100-32gb", 32768 * MiB, None, 125, 15.7, nvlink=150, network=12.5, pcie=12.5),
    # NVIDIA Ada GPU architecture whitepaper (RTX 4090): BF16/FP16 with FP32 accumulate 165 (330 sparse), FP32 82.6
    Gpu("rtx-4090", 24564 * MiB, 165, 165, 82.6, nvlink=25, network=12.5, pcie=25),
]}
# Short names that leave no doubt about the memory. "a100" and "v100" are not here: each comes in two
# memory sizes, and a plan for the wrong one says a layout fits when it does not (get_gpu lists them).
# "h100" means the SXM card: it and the PCIe card hold 80 GB (the NVL, 94 GB, is h100-nvl); `dstk plan`
# prints the preset it used.
ALIASES = {"a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100": "h100-sxm",
           "h100-80gb": "h100-sxm", "h200-141gb": "h200", "4090": "rtx-4090", "rtx4090": "rtx-4090"}
# torch.cuda.get_device_name() (lower case) -> preset; the first match wins. None: a card with no preset
# (its peak differs from its family's: GH200 is an H100 with 96/144 GB, H200 NVL runs at 835), so MFU is
# not guessed; `dstk plan --gpu-mem/--tflops` and the GPU bench's --peak-tflops take its figures.
DEVICE_NAMES = [(r"gh200", None), (r"h200.*nvl", None), (r"h200", "h200"), (r"h100.*nvl", "h100-nvl"),
                (r"h100.*pcie", "h100-pcie"), (r"h100", "h100-sxm"),
                (r"a100.*pcie.*80|a100.*80.*pcie", "a100-pcie-80gb"), (r"a100.*40", "a100-40gb"), (r"a100", "a100-80gb"),
                (r"l40s", "l40s"), (r"\bl4\b", "l4"), (r"a10g", "a10g"), (r"v100.*16", "v100-16gb"), (r"v100", "v100-32gb"),
                (r"4090", "rtx-4090")]


def preset_for_device(device_name: str) -> str | None:
    """The preset for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm"), or None for a card with none."""
    for pattern, preset in DEVICE_NAMES:
        if re.search(pattern, device_name.lower()):
            return preset
    return None


def get_gpu(name: str) -> Gpu:
    """A preset by name (case-insensitive, aliases allowed), or a ConfigError that suggests one."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in GPUS or key in ALIASES:
        return GPUS[ALIASES.get(key, key)]
    several = [g for name, g in GPUS.items() if name.startswith(key + "-")]
    if len(several) > 1:
        shown = ", ".join(f"{g.name} ({format_bytes(g.memory)})" for g in several)
        raise ConfigError(f"--gpu {name!r} matches {len(several)} presets: {shown}; give --gpu one of these names")
    close = difflib.get_close_matches(key, list(GPUS) + list(ALIASES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(ALIASES.get(c, c)) for c in close)}?" if close else ""
    raise ConfigError(f"--gpu {name!r} is not a known GPU.{hint} Known: {', '.join(GPUS)}; "
                      f"or give --gpu-mem SIZE and --tflops N for another card")


def custom_gpu(memory: int, tflops: float, nvlink: float = 25.0, network: float = 12.5) -> Gpu:
    """A GPU described only by its memory and throughput (when no preset is named)."""
    return Gpu("custom", memory, tflops, tflops, tflops, nvlink=nvlink, network=network)


def with_overrides(gpu: Gpu, memory: int | None = None, tflops: float | None = None,
                   nvlink: float | None = None, network: float | None = None) -> Gpu:
    """The preset with the user's figures in place of the datasheet's."""
    changes = {"memory": memory, "nvlink": nvlink, "network": network}
    changes = {k: v for k, v in changes.items() if v is not None}
    if tflops is not None:
        changes.update(bf16_tflops=tflops, fp16_tflops=tflops, fp32_tflops=tflops)
    return replace(gpu, **changes)


_UNITS = {"": GiB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": MiB, "gib": GiB, "tib": 2**40}


def parse_size(text: str, flag: str = "--gpu-mem") -> int:
    """'80GiB' -> bytes. GB = 10^9, GiB = 2^30; a bare number means GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"{flag} {text!r}: expected a size such as 80GiB, 24GB or 16384MiB")
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise ConfigError(f"{flag} {text!r} is not a finite size; check for extra digits")
    size = int(size)
    if size <= 0:
        raise ConfigError(f"{flag} {text!r} must be a positive size")
    return size


def format_bytes(n: float) -> str:
    """Bytes as GiB/MiB with 3 significant digits: 1.5 GiB, 512 MiB."""
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
