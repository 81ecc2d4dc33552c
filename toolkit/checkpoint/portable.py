"""Moving a run to another layout (pp, dp, sp, ZeRO 0-3): a checkpoint's training state by HF name, and
putting it into an engine built for the new layout.

A dstk checkpoint knows which HF tensor every pipeline layer holds (the manifest's hf_names), so a
parameter's state can be named independently of where it lived:
  weights      fp32 masters by HF name (toolkit.checkpoint.state.load_state_dict)
  exp_avg, exp_avg_sq   Adam's moments by HF name, from whichever form DeepSpeed wrote:
               ZeRO-0 (torch's optimizer state, indexed in the order the run gave its parameters to the
               optimizer: the `param_names` each rank saves with its checkpoint), or ZeRO-1/2 and the
               bf16 optimizer (flat fp32 partitions per data-parallel rank and stage, with
               param_slice_mappings: name -> where its fragment starts), or ZeRO-3 (pp = 1: per dp rank a
               flat partition; a parameter of n elements takes ceil(n / dp) of them on every rank, in the
               order of the model states' param_shapes, as zero_to_fp32 reads the weights)
  the optimizer step, the LR scheduler, DeepSpeed's global step / sample counters.
`restore` then writes each parameter's state into the new engine: the module weight itself and, where
DeepSpeed keeps fp32 partitions, this rank's share of its high-precision copy and moments (ZeRO-1/2,
bf16: through the parameter's fragment mapping, then DeepSpeed's own map_to_flat_opt_states; ZeRO-3:
the parameter's slice of the sub-group's flat partition); a plain torch optimizer (ZeRO-0 fp32) gets
its state directly, DeepSpeed's FP16 wrappers (bf16/fp16 at ZeRO-0) in their fp32 masters
(toolkit.distributed.optimizers). The data position is the global step (the order of rows is the same on every
layout) and dropout RNG streams restart from the seed.
"""

import enum
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import UnusableInput
from toolkit.checkpoint.deepspeed_files import (Kind, checkpoint_kind, join, model_states, param_shapes,
                                                partition_files, torch_load, zero3_full, zero3_model_states,
                                                zero3_pieces, zero3_rank_share, zero3_table)
from toolkit.checkpoint.manifest import META, hf_name_of, moved_keys
from toolkit.checkpoint.state import load_state_dict, masters_by_hf_name, partition_fragments, resolve_tag
from toolkit.distributed.optimizers import is_bf16_optimizer, is_fp16_wrapper, restore_masters

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class PortableState:
    """A checkpoint's training state by HF name (tensors flat or shaped; restore reshapes)."""

    weights: dict
    moments: dict  # "exp_avg" / "exp_avg_sq" -> {HF name: tensor}
    optimizer_step: int
    engine: dict = field(default_factory=dict)  # lr_scheduler, global_steps, global_samples, skipped_steps


def moved(saved: dict, now: dict) -> list:
    """The layout keys (pp, dp, tp, sp, zero_stage) that differ between a checkpoint's manifest and this run's."""
    return moved_keys(saved, now)


PORTABLE = "portable"  # a tag's folder of HF-named state, written by `dstk reshard`
KINDS = ("weights",) + MOMENTS


def is_portable(tag_dir: Path) -> bool:
    return (Path(tag_dir) / PORTABLE / "engine.pt").is_file()


def read(ckpt_dir, tag=None, wanted=None) -> PortableState:
    """The state of checkpoint `tag` of CKPT_DIR by HF name: from DeepSpeed's files, or from the portable
    folder `dstk reshard` wrote (there only the `wanted` HF names are read, when given)."""
    ckpt_dir = Path(ckpt_dir)
    tag = resolve_tag(ckpt_dir, tag)
    tag_dir = ckpt_dir / tag
    if is_portable(tag_dir):
        from models.autoep import is_autoep_name

        if wanted is not None and any(map(is_autoep_name, wanted)):  # an AutoEP rank's tensors cut from HF ones
            wanted = None
        return _read_portable(tag_dir / PORTABLE, wanted)
    weights, manifest = load_state_dict(ckpt_dir, tag)
    kind = checkpoint_kind(tag_dir, manifest)
    if kind is Kind.EXPERT_PARALLEL:
        from toolkit.checkpoint.experts import autoep_moments

        moments, step = autoep_moments(tag_dir, manifest, ckpt_dir / META)
    elif kind is Kind.ZERO3:
        moments, step = _from_zero3(tag_dir)
    elif kind in (Kind.ZERO12, Kind.BF16_OPTIMIZER, Kind.PIPELINE_PARTITIONED):
        moments, step = _from_partitions(list(partition_files(tag_dir).values()), manifest)
    else:  # ZeRO-0: torch's optimizer state in the model states files
        moments, step = from_torch_states(tag_dir, manifest)
    first = torch_load(_model_states(tag_dir))
    engine = {k: first.get(k) for k in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")}
    return PortableState(weights, moments, step, engine)


def write(state: PortableState, folder: Path) -> int:
    """FOLDER/{weights,exp_avg,exp_avg_sq}.safetensors (HF names, fp32) and engine.pt; returns bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    total = 0
    for kind, tensors in zip(KINDS, (state.weights, *(state.moments[k] for k in MOMENTS))):
        tensors = {k: v.to(torch.float32, copy=True).contiguous() for k, v in tensors.items()}  # tied: own copies
        save_file(tensors, str(folder / f"{kind}.safetensors"))
        total += sum(t.numel() * 4 for t in tensors.values())
    torch.save({"optimizer_step": state.optimizer_step, **state.engine}, folder / "engine.pt")
    return total


STAGED = "staged-by-dstk-train"  # in a portable folder a move made (and removes), not one `dstk reshard` wrote


def stage(ckpt_dir: Path, tag: str) -> bool:
    """Before a move, on every rank: rank 0 writes the tag's state by HF name into TAG/portable (atomically),
    so that every rank then reads only the tensors it holds instead of each one reading the whole
    checkpoint. True when the folder is a staged one (the caller removes it once every rank has read
    it; one left by a move that failed is used and removed); a failure on rank 0 is raised on every
    rank (toolkit.distributed.agreement). The others wait for rank 0 in the agreement's patient group, not within
    the process group's timeout: reading and writing a large model's state can take longer."""
    import os
    import shutil

    import torch.distributed as dist

    from toolkit.distributed.agreement import agree

    tag_dir = Path(ckpt_dir) / tag
    with agree("staging the checkpoint for the move", name_ranks=False):  # however long rank 0 takes
        if dist.get_rank() == 0 and not is_portable(tag_dir):
            for old in tag_dir.glob(f".{PORTABLE}.*"):  # a temp folder of a staging that was killed
                shutil.rmtree(old, ignore_errors=True)
            tmp = tag_dir / f".{PORTABLE}.{os.getpid()}"
            try:
                write(read(ckpt_dir, tag), tmp)
                (tmp / STAGED).touch()
                tmp.rename(tag_dir / PORTABLE)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return (tag_dir / PORTABLE / STAGED).is_file()


def _read_portable(folder: Path, wanted=None) -> PortableState:
    from safetensors import safe_open

    found = {}
    for kind in KINDS:
        with safe_open(str(folder / f"{kind}.safetensors"), framework="pt") as f:
            found[kind] = {k: f.get_tensor(k) for k in f.keys() if wanted is None or k in wanted}
    engine = torch_load(folder / "engine.pt")
    step = engine.pop("optimizer_step")
    return PortableState(found["weights"], {k: found[k] for k in MOMENTS}, step, engine)


def _from_partitions(paths: list, manifest: dict) -> tuple:
    """ZeRO-1/2 and bf16 optimizer files: the moments' fragments by name, joined across dp ranks."""
    steps = []

    def moments(saved):
        states = saved["base_optimizer_state"]["state"]
        groups = [states[g] if g in states else states[list(states)[g]] for g in range(len(states))]
        steps.extend(int(state["step"]) for state in groups)
        return [{key: state[key] for key in MOMENTS} for state in groups]

    pieces = partition_fragments(paths, moments)
    return {key: _by_hf_name(pieces[key], manifest) for key in MOMENTS}, max(steps)


def _from_zero3(tag_dir: Path) -> tuple:
    """ZeRO-3 (pp = 1): dp rank r's file holds per sub-group the flat partition of each moment; the
    sub-groups end to end are r's share of every parameter (deepspeed_files.zero3_table)."""
    paths = list(partition_files(tag_dir).values())  # in dp-rank order (mp 0)
    table = zero3_table(param_shapes(torch_load(_model_states(tag_dir))), len(paths))
    flats, step = {key: [] for key in MOMENTS}, 0  # moment -> [rank][sub-group]
    for path in paths:
        states = torch_load(path)["optimizer_state_dict"]["optimizer_state_dict"]["state"]
        for key in MOMENTS:
            flats[key].append([states[i][key] for i in sorted(states)])
        step = int(states[min(states)]["step"])
    out = {key: {} for key in MOMENTS}
    for name, (offset, share, shape) in table.items():
        for key in MOMENTS:
            pieces = [piece for rank_flats in flats[key] for piece in zero3_pieces(rank_flats, offset, share)]
            out[key][name] = zero3_full(pieces, (shape.numel(),))  # flat: restore reshapes
    return out, step


def _model_states(tag_dir: Path) -> Path:
    """The file holding the engine's counters and LR scheduler (rank 0's own under ZeRO-3)."""
    zero3 = tag_dir / zero3_model_states()
    return zero3 if zero3.is_file() else tag_dir / model_states()


def from_torch_states(tag_dir: Path, manifest: dict) -> tuple:
    """ZeRO-0: each stage's mp_rank_XX_model_states.pt holds torch's optimizer state_dict (under bf16/fp16 inside
    the FP16 wrapper's), whose state i is the i-th parameter given to the optimizer (FP16_Optimizer: the i-th
    group's parameters end to end); `param_names` (saved by dstk with the checkpoint, or the manifest's
    param_groups at pp = 1) names them in that order."""
    pieces = {key: {} for key in MOMENTS}
    step = 0
    for stage in range(manifest.get("pp", 1)):
        path = tag_dir / model_states(stage)
        saved = torch_load(path)
        names = saved.get("param_names") or manifest.get("param_groups")
        optimizer = saved.get("optimizer") or {}
        optimizer = optimizer.get("optimizer_state_dict", optimizer)  # an FP16 wrapper's holds the base optimizer's
        if not names or "state" not in optimizer:
            raise UnusableInput(f"{path} does not name its optimizer's parameters (a checkpoint from an older dstk): "
                                "resume it with the layout it was written with")
        for name, state in _states_by_name(saved, optimizer["state"], names, path):
            step = int(state["step"])
            for key in MOMENTS:
                pieces[key][(stage, name)] = [state[key]]
    return {key: _by_hf_name(found, manifest) for key, found in pieces.items()}, step


def _states_by_name(saved: dict, states: dict, names: list, path: Path):
    """(name, {step, moments flat}) per parameter: torch's state per parameter, or FP16_Optimizer's per group
    (its flat moments cut by the parameters' sizes, which pp = 1 model states hold)."""
    if "fp32_groups_flat" not in (saved.get("optimizer") or {}):
        order = [n for group in names for n in group]
        for index, state in states.items():
            yield order[index], {k: v.reshape(-1) if k in MOMENTS else v for k, v in state.items()}
        return
    module = saved.get("module") or {}
    if not all(n in module for group in names for n in group):
        raise UnusableInput(f"{path}: an fp16 pipeline's flat optimizer state (FusedAdam) cannot be cut into its "
                            "parameters; resume it with the layout it was written with")
    for index, state in states.items():
        sizes = [module[n].numel() for n in names[index]]
        cut = {k: state[k][: sum(sizes)].split(sizes) for k in MOMENTS}
        for i, name in enumerate(names[index]):
            yield name, {"step": state["step"], **{k: cut[k][i] for k in MOMENTS}}


def _by_hf_name(pieces: dict, manifest: dict) -> dict:
    """{(stage, module name): fragments} -> {HF name: flat tensor}; at pp = 1 module names are HF names."""
    if manifest.get("pp", 1) > 1:
        return masters_by_hf_name(pieces, manifest)
    return {name: join(fragments) for (_, name), fragments in pieces.items()}


def hf_names_of(module, manifest: dict) -> dict:
    """{parameter: HF name} for this rank's module: a pp = 1 model's own names; a pipeline stage's
    through the manifest's per-layer map (manifest.hf_name_of)."""
    if manifest.get("pp", 1) == 1:
        return {p: name for name, p in module.named_parameters()}
    if manifest.get("expert_parallel"):  # AutoEP's layers in the stages: their tensors under their block's HF name
        from toolkit.checkpoint.experts import stage_hf_name as named_as
    else:
        named_as = hf_name_of
    named = {p: named_as(name, manifest) for name, p in module.named_parameters()}
    return {p: hf for p, hf in named.items() if hf is not None}


class Keeper(enum.Enum):
    """Where an engine keeps a parameter's fp32 weight and Adam moments: what `restore` writes into. DeepSpeed
    picks it from the ZeRO stage and the precision (toolkit.distributed.optimizers lists which wrapper when)."""

    ZERO3 = "ZeRO-3: this rank's share of each parameter (p.ds_tensor) and of its fp32 copy and moments"
    FRAGMENTS = "ZeRO-1/2 or BF16_Optimizer: this rank's fragment of each parameter in flat fp32 partitions"
    FP16_WRAPPER = "bf16/fp16 at ZeRO-0: the FP16 wrapper's fp32 masters, one per parameter or per group"
    TORCH = "fp32 at ZeRO-0: torch's optimizer, on the module's own parameters"


def keeper_of(engine) -> Keeper:
    if engine.zero_optimization_stage() == 3:
        return Keeper.ZERO3
    if is_fp16_wrapper(engine.optimizer):
        return Keeper.FP16_WRAPPER
    if engine.zero_optimization_stage() in (1, 2) or is_bf16_optimizer(engine.optimizer):
        return Keeper.FRAGMENTS
    return Keeper.TORCH


def restore(engine, state: PortableState, names: dict) -> None:
    """Put `state` into a freshly initialised engine: every trainable parameter's weight, fp32 copy and
    Adam moments (by HF name), the optimizer step, LR scheduler and DeepSpeed's step counters."""
    import torch

    from models.autoep import layers

    module = getattr(engine, "module", None)  # a stand-in engine (tests) may hold none
    if module is not None and layers(module):  # AutoEP: this rank's experts and routers cut from the HF tensors
        from toolkit.checkpoint.experts import onto_autoep

        weights, moments = onto_autoep(engine.module, state.weights, state.moments, names)
        state = PortableState(weights, moments, state.optimizer_step, state.engine)
    missing = [hf for p, hf in names.items() if p.requires_grad and hf not in state.weights]
    if missing:
        raise UnusableInput(f"the checkpoint holds no state for {missing[:3]}: it was written by another model")
    keeper = keeper_of(engine)
    trained = {p: hf for p, hf in names.items() if p.requires_grad}  # frozen (LoRA's base): read from --model
    if keeper is Keeper.ZERO3:
        _restore_zero3(engine.optimizer, state, trained)
    else:
        for p, hf in trained.items():
            with torch.no_grad():
                p.data.copy_(state.weights[hf].reshape(p.shape).to(p.dtype))
        restore_optimizer = {Keeper.FRAGMENTS: _restore_fragments, Keeper.FP16_WRAPPER: _restore_fp16_wrapper,
                             Keeper.TORCH: _restore_torch}[keeper]
        restore_optimizer(engine.optimizer, state, trained)
        placed_as_loaded(engine.optimizer if keeper is Keeper.TORCH else engine.optimizer.optimizer)
    _restore_counters(engine, state.engine)


def placed_as_loaded(optimizer) -> None:
    """Every state tensor of torch optimizer `optimizer` put where its own load_state_dict puts it (DeepSpeed's
    resume on the saved layout loads the base optimizer that way): moments in the parameter's dtype on its device;
    the step as given (a CPU tensor) unless the group is fused or capturable, then float32 on the parameter's
    device (torch/optim/optimizer.py _process_value_according_to_param_policy), where those kernels read it:
    a CPU step under the fused CUDA AdamW is an illegal memory access at the first step. Tensors already in
    place are kept, not copied: the fragments DeepSpeed links into the flat moments (ZeRO-1/2, bf16) stay views."""
    optimizer.load_state_dict(optimizer.state_dict())


def _weight_and_moments(state: PortableState, hf: str, shape) -> tuple:
    """(fp32 weight, {moment: fp32 tensor}) of HF name `hf`, in `shape` (the state holds them flat or shaped)."""
    return state.weights[hf].reshape(shape), {key: state.moments[key][hf].reshape(shape).float() for key in MOMENTS}


def _restore_zero3(optimizer, state: PortableState, trained: dict) -> None:
    """ZeRO-3: Adam's state is made lazily, at the first step; it is made now (zeros), then every parameter's
    share written into it (_set_zero3). p.ds_shape: the full shape (p itself is an empty placeholder)."""
    import torch

    base = optimizer.optimizer
    for flat in optimizer.fp32_partitioned_groups_flat:
        base.state[flat] = {"step": _step(base, state.optimizer_step), **{k: torch.zeros_like(flat) for k in MOMENTS}}
    for p, hf in trained.items():
        _set_zero3(optimizer, p, *_weight_and_moments(state, hf, p.ds_shape))
    optimizer._set_fp32_optimizer_param_groups()  # the base optimizer holds its partitions only around a step and
    try:  # a load (DeepSpeed's _rigid_load_state_dict brackets its load_state_dict so)
        placed_as_loaded(base)
    finally:
        optimizer._clear_fp32_optimizer_param_groups()


def _restore_fragments(optimizer, state: PortableState, trained: dict) -> None:
    """ZeRO-1/2 and BF16_Optimizer: each parameter's fragment on this rank (p._hp_mapping, None where this
    rank holds none) of the fp32 copy and moments; then the flat partitions' Adam state from them."""
    from deepspeed.utils import safe_set_full_fp32_param

    for p, hf in trained.items():
        if p._hp_mapping is None:
            continue
        weight, moments = _weight_and_moments(state, hf, p.shape)
        safe_set_full_fp32_param(p, weight.to(p.device))
        at = p._hp_mapping.lp_fragment_address  # this partition's slice of the flattened parameter
        p._hp_mapping.optim_fragment = {k: v.flatten().narrow(0, at.start, at.numel).to(p.device).clone()
                                        for k, v in moments.items()}
    _flat_states(optimizer, state.optimizer_step)


def _restore_fp16_wrapper(optimizer, state: PortableState, trained: dict) -> None:
    """bf16/fp16 at ZeRO-0: the wrapper's fp32 masters and its base optimizer's state (optimizers.restore_masters)."""
    import torch

    wrapped = {id(p): _weight_and_moments(state, hf, p.shape) for p, hf in trained.items()}
    with torch.no_grad():
        restore_masters(optimizer, wrapped, _step(optimizer.optimizer, state.optimizer_step))


def _restore_torch(optimizer, state: PortableState, trained: dict) -> None:
    """fp32 at ZeRO-0: torch's optimizer state, keyed by the module's parameters."""
    for p, hf in trained.items():
        _, moments = _weight_and_moments(state, hf, p.shape)
        optimizer.state[p] = {"step": _step(optimizer, state.optimizer_step),
                              **{k: v.to(p.device) for k, v in moments.items()}}


def _set_zero3(optimizer, p, weight, moments: dict) -> None:
    """A ZeRO-3 parameter's share on this rank (deepspeed_files.zero3_rank_share), written into the module's
    partition (p.ds_tensor), the fp32 partition and each moment's. (deepspeed.utils.safe_set_full_fp32_param
    cuts the last rank's share with narrow() and fails when the parameter does not divide by dp.)"""
    import torch

    rank = optimizer._get_param_partition_rank(p)
    with torch.no_grad():
        p.ds_tensor.data.copy_(zero3_rank_share(weight, rank, p.ds_tensor))
        for key, full in ((None, weight), *moments.items()):
            part, _ = optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=True, optim_state_key=key)
            part.data.copy_(zero3_rank_share(full, rank, part))


def _step(optimizer, step: int):
    """Adam's step count as `optimizer` keeps it: torch's optimizers a float tensor (on the host; placed_as_loaded
    moves it where a fused or capturable group reads it), DeepSpeed's FusedAdam (CUDA) an int."""
    import torch

    return torch.tensor(float(step)) if type(optimizer).__module__.startswith("torch.") else int(step)


def _flat_states(optimizer, step: int) -> None:
    """Build the base optimizer's state of each flat fp32 partition from its parameters' fragments (what
    DeepSpeed's universal-checkpoint loader does: deepspeed.utils.tensor_fragment.map_to_flat_opt_states)."""
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    lp_groups = optimizer.bf16_groups if is_bf16_optimizer(optimizer) else optimizer.bit16_groups  # ZeRO-1/2
    base = optimizer.optimizer
    for group, lps in zip(base.param_groups, lp_groups):
        flat = group["params"][0]
        map_to_flat_opt_states(flat, lps, base.state, MOMENTS)
        base.state[flat]["step"] = _step(base, step)


def _restore_counters(engine, saved: dict) -> None:
    scheduler = engine.lr_scheduler
    if scheduler is not None and saved.get("lr_scheduler") is not None:
        scheduler.load_state_dict(saved["lr_scheduler"])
        # the optimizer's groups still hold the fresh engine's first LR: the next step must use the schedule's
        # (DeepSpeed's own load restores it with the optimizer's param_groups; groups differ between layouts)
        lrs = scheduler.get_lr()
        for group, lr in zip(engine.optimizer.param_groups, lrs * len(engine.optimizer.param_groups)
                             if len(lrs) == 1 else lrs):
            group["lr"] = lr
        scheduler._last_lr = [g["lr"] for g in engine.optimizer.param_groups]
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if saved.get(key) is not None:
            setattr(engine, key, saved[key])
