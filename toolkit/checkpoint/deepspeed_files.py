"""DeepSpeed's files in a checkpoint tag: their names, which kind of checkpoint a tag holds, and where a
parameter's fp32 state lies in them. Everything dstk reads of a tag asks here (deepspeed 0.19,
runtime/engine.py _get_ckpt_name / _get_zero_ckpt_name / ckpt_layer_path).

Files in a tag (mp rank = pipeline stage x tp + tp rank; dp rank within the stage):
  mp_rank_{mp:02d}_model_states.pt                 the module (pp = 1), counters, ZeRO-0's optimizer
  layer_{i:02d}[-model_{t:02d}]-model_states.pt    pipeline layer i (of tp rank t)
  [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   a dp rank's optimizer partition
  zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt          ZeRO-3: each rank's model states

How a parameter's fp32 state is cut over the dp ranks:
  ZeRO-1/2, BF16_Optimizer  per group, one flat partition per rank; param_slice_mappings says where
                            (start, numel) each parameter's fragment of it lies (`fragments`)
  ZeRO-3                    each parameter of n elements cut in `ranks` shares of ceil(n / ranks), the
                            last padded; a rank's shares end to end, in param_shapes order (`zero3_table`)
"""

import enum
import math
import re
from pathlib import Path

from toolkit.errors import UnusableInput

PARTITION_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")  # groups: dp, mp
MODEL_STATES_GLOB = "mp_rank_*_model_states.pt"


def model_states(mp: int = 0) -> str:
    return f"mp_rank_{mp:02d}_model_states.pt"


def zero3_model_states(dp: int = 0, mp: int = 0) -> str:
    return f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"


def layer_file(index: int, tp_rank: int | None = None) -> str:
    """Pipeline layer `index`'s file (global index); tp_rank for tp inside the stages."""
    rank = "" if tp_rank is None else f"-model_{tp_rank:02d}"
    return f"layer_{index:02d}{rank}-model_states.pt"


def stage_of_model_states(path: Path) -> int:
    """mp_rank_{mp:02d}_model_states.pt -> mp."""
    return int(path.name.split("_")[2])


def partition_files(tag_dir: Path) -> dict:
    """{(dp rank, mp rank): optimizer partition file} in the tag, ordered by mp rank, then dp rank."""
    found = {}
    for path in Path(tag_dir).iterdir():
        match = PARTITION_FILE.fullmatch(path.name)
        if match:
            found[int(match.group(1)), int(match.group(2))] = path
    return {key: found[key] for key in sorted(found, key=lambda k: (k[1], k[0]))}


class Kind(enum.Enum):
    """What a tag holds, as dstk reads it. pp and tp come from the manifest, the rest from the files."""

    PIPELINE = "pipeline: layer files; fp32 masters (bf16/fp16 at ZeRO-0) in each stage's mp_rank file"
    PIPELINE_PARTITIONED = "pipeline: layer files; fp32 masters in ZeRO-1 / BF16_Optimizer partition files"
    PIPELINE_TP = "pipeline with tp inside the stages: layer files per tp rank"
    TENSOR_PARALLEL = "pp = 1, AutoTP at ZeRO 0-2: one mp_rank file per tp rank"
    ZERO3_TENSOR_PARALLEL = "pp = 1, AutoTP at ZeRO-3: a partition file per dp x tp rank"
    MODULE = "pp = 1, ZeRO-0: mp_rank_00 holds the module (+ the FP16 wrappers' fp32 masters)"
    BF16_OPTIMIZER = "pp = 1, BF16_Optimizer's partitions (no zero_stage: zero_to_fp32 refuses them)"
    ZERO12 = "pp = 1, ZeRO-1/2 partitions"
    ZERO3 = "pp = 1, ZeRO-3 partitions"
    EXPERT_PARALLEL = "DeepSpeed's AutoEP (pp 1, or inside pipeline stages): experts per ep rank (checkpoint.experts)"


def checkpoint_kind(tag_dir: Path, manifest: dict) -> Kind:
    """The one place that decides how a tag is read (state, stream and portable all ask)."""
    pp, tp = manifest.get("pp", 1), manifest.get("tp", 1)
    if manifest.get("expert_parallel"):  # inside pipeline stages too: each stage's files
        return Kind.EXPERT_PARALLEL
    if pp > 1:
        if tp > 1:
            return Kind.PIPELINE_TP
        return Kind.PIPELINE_PARTITIONED if partition_files(tag_dir) else Kind.PIPELINE
    if tp > 1:
        return Kind.ZERO3_TENSOR_PARALLEL if manifest.get("zero_stage") == 3 else Kind.TENSOR_PARALLEL
    optim = optim_files(tag_dir)
    if not optim:
        return Kind.MODULE
    if bf16_optimizer_files(tag_dir):
        return Kind.BF16_OPTIMIZER
    stage = (torch_load(optim[0], mmap=True).get("optimizer_state_dict") or {}).get("zero_stage")
    return Kind.ZERO3 if stage == 3 else Kind.ZERO12


def optim_files(tag_dir: Path) -> list:
    """Every *_optim_states.pt of the tag, in natural order (zero_pp_rank_2 before zero_pp_rank_10)."""
    return sorted(Path(tag_dir).glob("*_optim_states.pt"), key=natural_order)


def natural_order(path: Path) -> list:
    """A sort key: the numbers in a file's name compared as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def bf16_optimizer_files(tag_dir: Path) -> list:
    """pp = 1 files of DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1 with fp32 gradient accumulation), [] for
    any other kind: its partitions carry no "zero_stage", so DeepSpeed's zero_to_fp32 refuses them."""
    files = sorted(Path(tag_dir).glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    if not files:
        return []
    saved = torch_load(files[0], mmap=True).get("optimizer_state_dict") or {}
    return files if "zero_stage" not in saved and "param_slice_mappings" in saved else []


def fragments(mappings: list, flats: list, wanted=None):
    """(name, fragment) for each parameter in one rank's ZeRO-1/2 or BF16_Optimizer partition: mappings is
    the file's param_slice_mappings (per group, name -> fragment address: start, numel in the group's flat
    partition), flats the group's flat tensors (the masters, or a moment). A parameter's fragments over the
    dp ranks, in rank order and joined, are its flat tensor. wanted: the names to give (default all), a
    predicate or a collection (looked up, not scanned)."""
    for flat, mapping in zip(flats, mappings):
        if wanted is None or callable(wanted):
            names = [n for n in mapping if wanted is None or wanted(n)]
        else:
            names = [n for n in wanted if n in mapping]
        for name in names:
            where = mapping[name]
            yield name, flat.narrow(0, where.start, where.numel)


def param_shapes(saved: dict) -> list:
    """(name, shape) of every trainable parameter in a model states file, its groups end to end: the
    order ZeRO lays the parameters out in its partitions."""
    return [item for group in saved["param_shapes"] for item in group.items()]


def zero3_share(numel: int, ranks: int) -> int:
    """Elements of a parameter of `numel` elements each of `ranks` ZeRO-3 ranks holds (the last padded)."""
    return -(-numel // ranks)  # ceil, in integers


def zero3_table(param_shapes, ranks) -> dict:
    """{name: (offset, share, shape)}: where each parameter's share lies in a rank's ZeRO-3 partition, the
    groups laid end to end. param_shapes: (name, shape) in the model states' order; ranks: how many ranks
    the parameters are cut over (an int, or name -> int where some span more ranks than others)."""
    table, offset = {}, 0
    for name, shape in param_shapes:
        share = zero3_share(math.prod(shape), ranks(name) if callable(ranks) else ranks)
        table[name], offset = (offset, share, shape), offset + share
    return table


def zero3_pieces(rank_flats: list, offset: int, share: int) -> list:
    """The views of elements offset..offset + share in one rank's flat groups laid end to end (no copy)."""
    out, start = [], 0
    for flat in rank_flats:
        end = start + flat.numel()
        if offset < end and offset + share > start:
            out.append(flat[max(offset, start) - start: min(offset + share, end) - start])
        start = end
    return out


def zero3_full(pieces: list, shape, copy: bool = False):
    """A ZeRO-3 parameter from its ranks' shares (in rank order): joined, the padding cut, shaped."""
    return join(pieces, copy)[: math.prod(shape)].view(shape)


def zero3_rank_share(full, rank: int, like):
    """What rank `rank` holds of tensor `full` under ZeRO-3: elements [rank x n, (rank + 1) x n) of it
    flattened, n = like.numel(), zero-padded past its end; in like's dtype, device and shape."""
    import torch

    mine = full.reshape(-1)[rank * like.numel():(rank + 1) * like.numel()]
    out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
    out[:mine.numel()] = mine.to(like.dtype)
    return out.view_as(like)


def join(fragments: list, copy: bool = False):
    """A parameter's fragments (in rank order) as one flat tensor. copy: a lone fragment is cloned too
    (a view would keep its whole mmap'd file alive)."""
    import torch

    if len(fragments) > 1:
        return torch.cat(fragments)
    return fragments[0].clone() if copy else fragments[0]


def torch_load(path: Path, mmap: bool = False):
    """torch.load as data (toolkit.checkpoint.safe_load: a class outside DeepSpeed's is refused), with a
    one-line error for a missing, truncated or foreign file. mmap: the tensors stay in the file (pages are
    read when touched, and let go with the last tensor)."""
    import pickle
    import zipfile

    from toolkit.checkpoint import safe_load

    if not path.is_file():
        raise UnusableInput(f"{path} is missing: the checkpoint is incomplete or from another layout")
    try:
        return safe_load.load(path, mmap=mmap)
    except UnusableInput:  # a class outside the list: its own line
        raise
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise UnusableInput(f"{path} cannot be read ({first_line(exc)}): the file is truncated or damaged "
                            "(a save cut short?); export another tag with --tag") from None


def first_line(exc: Exception) -> str:
    """The first sentence of an exception's message (torch's run to a paragraph)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line.split(". ")[0].rstrip(".")
