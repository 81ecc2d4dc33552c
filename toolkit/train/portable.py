"""Moving a run to another layout (pp, dp, ZeRO 0-2): a checkpoint's training state by HF name, and
putting it into an engine built for the new layout.

A dstk checkpoint knows which HF tensor every pipeline layer holds (layout.json's hf_names), so a
parameter's state can be named independently of where it lived:
  weights      fp32 masters by HF name (toolkit.train.checkpoint_state.load_state_dict)
  exp_avg, exp_avg_sq   Adam's moments by HF name, from whichever form DeepSpeed wrote:
               ZeRO-0 (torch's optimizer state, indexed in the order the run gave its parameters to the
               optimizer: the `param_names` each rank saves with its checkpoint), or ZeRO-1/2 and the
               bf16 optimizer (flat fp32 partitions per data-parallel rank and stage, with
               param_slice_mappings: name -> where its fragment starts)
  the optimizer step, the LR scheduler, DeepSpeed's global step / sample counters.
`restore` then writes each parameter's state into the new engine: the module weight itself and, where
DeepSpeed keeps fp32 partitions (ZeRO-1/2, bf16), its high-precision copy and moments through
deepspeed.utils' safe_set_full_* API; a plain torch optimizer (ZeRO-0 fp32) gets its state directly.
The data position is the global step (the order of rows is the same on every layout) and dropout
RNG streams restart from the seed. ZeRO-3 checkpoints are refused (their fragments carry no names).
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import UnusableInput
from toolkit.train.checkpoint_state import _masters_by_hf_name, _torch_load, load_state_dict, resolve_tag

MOMENTS = ("exp_avg", "exp_avg_sq")
LAYOUT_KEYS = ("pp", "dp", "zero_stage")  # what may differ between the checkpoint and the resumed run
_PARTITION = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


@dataclass
class PortableState:
    """A checkpoint's training state by HF name (tensors flat or shaped; restore reshapes)."""

    weights: dict
    moments: dict  # "exp_avg" / "exp_avg_sq" -> {HF name: tensor}
    optimizer_step: int
    engine: dict = field(default_factory=dict)  # lr_scheduler, global_steps, global_samples, skipped_steps


def moved(saved_layout: dict, now: dict) -> list:
    """The layout keys (pp, dp, zero_stage) whose values differ between a checkpoint and this run."""
    return [k for k in LAYOUT_KEYS if k in saved_layout and saved_layout[k] != now.get(k)]


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
        return _read_portable(tag_dir / PORTABLE, wanted)
    weights, layout = load_state_dict(ckpt_dir, tag)
    partitions = sorted(p for p in tag_dir.iterdir() if _PARTITION.fullmatch(p.name))
    if partitions:
        moments, step = _from_partitions(partitions, layout)
    else:
        moments, step = _from_torch_states(tag_dir, layout)
    first = _torch_load(tag_dir / "mp_rank_00_model_states.pt")
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


def _read_portable(folder: Path, wanted=None) -> PortableState:
    from safetensors import safe_open

    found = {}
    for kind in KINDS:
        with safe_open(str(folder / f"{kind}.safetensors"), framework="pt") as f:
            found[kind] = {k: f.get_tensor(k) for k in f.keys() if wanted is None or k in wanted}
    engine = _torch_load(folder / "engine.pt")
    step = engine.pop("optimizer_step")
    return PortableState(found["weights"], {k: found[k] for k in MOMENTS}, step, engine)


def _from_partitions(paths: list, layout: dict) -> tuple:
    """ZeRO-1/2 and bf16 optimizer files: each holds, per parameter group, this (dp rank, stage)'s flat
    partition of the moments and param_slice_mappings; fragments are joined across dp ranks in order."""
    pieces = {key: {} for key in MOMENTS}
    step = 0
    for path in sorted(paths, key=lambda p: tuple(map(int, _PARTITION.fullmatch(p.name).groups()))[::-1]):
        stage = int(_PARTITION.fullmatch(path.name).group(2))
        saved = _torch_load(path).get("optimizer_state_dict") or {}
        if "param_slice_mappings" not in saved:
            raise UnusableInput(f"{path}: a ZeRO-3 (or unnamed) optimizer partition; moving a ZeRO-3 checkpoint to "
                                "another layout is not supported: resume it with its own layout")
        states = saved["base_optimizer_state"]["state"]
        for group, mapping in enumerate(saved["param_slice_mappings"]):
            state = states[group] if group in states else states[list(states)[group]]
            step = int(state["step"])
            for name, where in mapping.items():
                for key in MOMENTS:
                    pieces[key].setdefault((stage, name), []).append(state[key].narrow(0, where.start, where.numel))
    return {key: _by_hf_name(found, layout) for key, found in pieces.items()}, step


def _from_torch_states(tag_dir: Path, layout: dict) -> tuple:
    """ZeRO-0: each stage's mp_rank_XX_model_states.pt holds torch's optimizer state_dict, whose state i
    is the i-th parameter given to the optimizer; `param_names` (saved by dstk with the checkpoint, or
    the layout's param_groups at pp = 1) names them in that order."""
    pieces = {key: {} for key in MOMENTS}
    step = 0
    for stage in range(layout.get("pp", 1)):
        path = tag_dir / f"mp_rank_{stage:02d}_model_states.pt"
        saved = _torch_load(path)
        names = saved.get("param_names") or layout.get("param_groups")
        optimizer = saved.get("optimizer") or {}
        if not names or "state" not in optimizer:
            raise UnusableInput(f"{path} does not name its optimizer's parameters (a checkpoint from an older dstk): "
                                "resume it with the layout it was written with")
        order = [n for group in names for n in group]
        for index, state in optimizer["state"].items():
            step = int(state["step"])
            for key in MOMENTS:
                pieces[key][(stage, order[index])] = [state[key].reshape(-1)]
    return {key: _by_hf_name(found, layout) for key, found in pieces.items()}, step


def _by_hf_name(pieces: dict, layout: dict) -> dict:
    """{(stage, module name): fragments} -> {HF name: flat tensor}; at pp = 1 module names are HF names."""
    if layout.get("pp", 1) > 1:
        return _masters_by_hf_name(pieces, layout)
    import torch

    return {name: torch.cat(fragments) if len(fragments) > 1 else fragments[0]
            for (_, name), fragments in pieces.items()}


def hf_names_of(module, layout: dict) -> dict:
    """{parameter: HF name} for this rank's module: a pp = 1 model's own names; a pipeline stage's
    "<layer>.<key>" / "tied_modules.<tie>.<key>" through the layout's per-layer map."""
    if layout.get("pp", 1) == 1:
        return {p: name for name, p in module.named_parameters()}
    hf_names, tied = layout["hf_names"], layout.get("tied", {})
    out = {}
    for name, p in module.named_parameters():
        head, _, key = name.partition(".")
        if head == "tied_modules":
            tie, _, key = key.partition(".")
            index = min(tied[tie])
        else:
            index = int(head)
        hf = hf_names[index].get(key)
        if hf is not None:
            out[p] = hf
    return out


def restore(engine, state: PortableState, names: dict) -> None:
    """Put `state` into a freshly initialised engine: every trainable parameter's weight, fp32 copy and
    Adam moments (by HF name), the optimizer step, LR scheduler and DeepSpeed's step counters."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param

    missing = [hf for p, hf in names.items() if p.requires_grad and hf not in state.weights]
    if missing:
        raise UnusableInput(f"the checkpoint holds no state for {missing[:3]}: it was written by another model")
    partitioned = False
    for p, hf in names.items():
        if not p.requires_grad:
            continue  # frozen (LoRA's base): read from --model, never trained
        shape = getattr(p, "ds_shape", p.shape)
        weight = state.weights[hf].reshape(shape)
        moments = {key: state.moments[key][hf].reshape(shape).float() for key in MOMENTS}
        with torch.no_grad():
            p.data.copy_(weight.to(p.dtype))
        if getattr(p, "_hp_mapping", None) is not None:  # ZeRO-1/2, bf16: this rank's fp32 fragment and moments
            partitioned = True
            safe_set_full_fp32_param(p, weight.to(p.device))
            at = p._hp_mapping.lp_fragment_address  # this partition's slice of the flattened parameter
            p._hp_mapping.optim_fragment = {k: v.flatten().narrow(0, at.start, at.numel).to(p.device).clone()
                                            for k, v in moments.items()}
        elif not hasattr(p, "_hp_mapping"):  # torch's optimizer on the module's own parameters (ZeRO-0 fp32)
            engine.optimizer.state[p] = {"step": torch.tensor(float(state.optimizer_step)),
                                         **{k: v.to(p.device) for k, v in moments.items()}}
    if partitioned:
        _flat_states(engine.optimizer, state.optimizer_step)
    _restore_counters(engine, state.engine)


def _flat_states(optimizer, step: int) -> None:
    """Build the base optimizer's state of each flat fp32 partition from its parameters' fragments (what
    DeepSpeed's universal-checkpoint loader does: deepspeed.utils.tensor_fragment.map_to_flat_opt_states)."""
    import torch
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    lp_groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups")  # ZeRO-1/2, bf16
    base = optimizer.optimizer
    for group, lps in zip(base.param_groups, lp_groups):
        flat = group["params"][0]
        map_to_flat_opt_states(flat, lps, base.state, MOMENTS)
        base.state[flat]["step"] = torch.tensor(float(step))


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
