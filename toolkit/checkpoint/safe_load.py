"""A checkpoint is data, not a program: every .pt dstk or DeepSpeed reads from a checkpoint tag is opened with
torch.load(weights_only=True), the few classes DeepSpeed and dstk really save allowed for that load only
(torch.serialization.safe_globals: nothing is added process-wide). A pickle naming any other class (os.system, a
__reduce__ planted in a downloaded run) is refused before it is loaded, naming the file and the class.
--trust-checkpoint (`trust(True)`) loads as before: torch.load(weights_only=False), which runs what a pickle says.

The list was found by saving every layout the suite covers (pp, tp inside stages, sp, dualpipev, ZeRO 0-3,
bf16/fp16, LoRA) and listing what torch.serialization.get_unsafe_globals_in_checkpoint named in each tag's files.
"""

import pickle
from pathlib import Path

from toolkit.errors import UnusableInput

ALLOWED = (  # (module, name) of the classes in DeepSpeed 0.19's checkpoint files
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # ZeRO and BF16_Optimizer optimizer files
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # the same files: bf16 / fp32 loss scaler
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # fp16 runs' optimizer files
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO-1/2 and BF16_Optimizer param_slice_mappings
)
# rng_state_R.pt of dstk before its RNG files held plain data: numpy's generator state as a pickled array
OLD_RNG = (("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"), ("numpy", "dtype"),
           ("numpy.dtypes", "UInt32DType"))  # the keys' dtype's class (numpy >= 1.25), built, not named, by the pickle
RNG_FILE_PREFIX = "rng_state_"

_trusted = False  # --trust-checkpoint: this process loads checkpoints as pickles


def trust(on: bool) -> None:
    """--trust-checkpoint for this process (each command and each rank sets it from its own flag)."""
    global _trusted
    _trusted = bool(on)


def trusted() -> bool:
    return _trusted


def _classes(path: Path) -> list:
    """The classes allowed in `path`: DeepSpeed's, and numpy's array for an RNG file of an older dstk."""
    import importlib

    allowed = ALLOWED + (OLD_RNG if Path(path).name.startswith(RNG_FILE_PREFIX) else ())
    found = []
    for module, name in allowed:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another numpy / DeepSpeed: the file cannot name it either
            continue
    return found


def load(path, map_location="cpu", mmap: bool = False):
    """torch.load of one checkpoint file as data (see the module's docstring); a refusal, one line, for a
    class outside the list."""
    import torch

    if _trusted:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    with torch.serialization.safe_globals(_classes(path)):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            unsafe = _unsafe(path) or [_first_line(exc)]
            raise UnusableInput(refusal(path, unsafe)) from None


def _unsafe(path) -> list:
    """What `path`'s pickle names outside the list, read without running it ([] for a file that is not
    torch.save's zip: its load says what is wrong with it)."""
    import torch

    with torch.serialization.safe_globals(_classes(path)):
        try:
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception:  # noqa: BLE001  (truncated, foreign: reported by the load itself)
            return []


def refusal(path, unsafe: list) -> str:
    return (f"{path} holds {', '.join(unsafe)}, which no checkpoint of dstk or DeepSpeed saves: loading it could run "
            "code, so it was not loaded; if you trust where this checkpoint came from, pass --trust-checkpoint")


def check_tag(tag_dir) -> None:
    """Refuse a tag any of whose .pt files names a class outside the list, before anything of it is loaded
    (every rank reads the same files and says the same line). Nothing to check under --trust-checkpoint."""
    if _trusted:
        return
    for path in sorted(Path(tag_dir).rglob("*.pt")):
        unsafe = _unsafe(path)
        if unsafe:
            raise UnusableInput(refusal(path, unsafe))


def _first_line(exc: Exception) -> str:
    """What torch's weights_only unpickler refused, from its paragraph (a class the pickle builds without naming
    it, which the static scan cannot see)."""
    for line in str(exc).splitlines():
        for mark in ("but got ", "Unsupported global: "):
            if mark in line:
                return line.split(mark, 1)[1].strip().rstrip(".")
    return "a class torch's weights_only unpickler refused"
