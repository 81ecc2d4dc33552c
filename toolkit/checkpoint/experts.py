"""An expert-parallel run's checkpoint (DeepSpeed 0.19.8's AutoEP at pp 1) by HF name: its weights and Adam moments.

AutoEP replaces each MoE block with its own layer (models.autoep): ep consecutive ranks each hold E / ep of every
block's experts as experts.w1/w2/w3 [E / ep, ...]. What DeepSpeed writes (runtime/engine.py _save_moe_checkpoint):
  mp_rank_00_model_states.pt      the module without the experts (the router as router.gate.weight)
  layer_L_expert_E_mp_rank_00_model_states.pt   expert E of MoE block L: {BLOCK.experts.wN.E: [I, H] / [H, I]}
  zero_pp_rank_R_mp_rank_00_optim_states.pt     ZeRO-1/2: rank R's partitions. The dense groups are cut over all dp
      ranks, as without ep; the expert groups (the "moe" ones) over the expert-data-parallel group of R: the ranks
      holding the same experts, R % ep = e, in rank order (R // ep), whose joined fragments are ep rank e's
      experts.wN [E / ep, ...].
Here they become the fp32 masters and moments of the HF model's own tensors (every expert, fused as transformers
holds them), by models.autoep.to_hf; `onto_autoep` cuts them back into an AutoEP engine's (a move onto ep). ZeRO-0 holds each expert in its file (the weights) and each ep rank's torch optimizer state in
expp_rank_E_mp_rank_00_optim_states.pt, in the engine's parameter order after initialize (the manifest's
param_groups). ZeRO-3: each rank's zero_pp_rank_R files, the experts in ZeRO-3 shares of their expert-data-parallel
group (`_zero3`).
"""

import contextlib
import functools
from pathlib import Path

from toolkit.checkpoint.deepspeed_files import (fragments, join, model_states, param_shapes, partition_files,
                                                torch_load, zero3_full, zero3_model_states, zero3_pieces, zero3_table)
from toolkit.errors import UnusableInput

MOMENTS = ("exp_avg", "exp_avg_sq")


def autoep_weights(tag_dir: Path, manifest: dict, meta: Path) -> dict:
    """{HF name: fp32 master} of an AutoEP checkpoint (meta: the run's dstk/ folder, config.json)."""
    saved = _model_states(tag_dir, manifest)
    module = {k: v for k, v in (saved.get("module") or {}).items() if v.numel()}  # ZeRO-3: its buffers alone
    if manifest.get("zero_stage") == 3:
        module.update(_zero3(tag_dir, lambda opt: {"weights": list(opt["fp32_flat_groups"])})["weights"])
    elif partition_files(tag_dir):
        module.update(_partitioned(tag_dir, manifest, saved, lambda opt: [{"weights": f} for f in
                                                                         opt["single_partition_of_fp32_groups"]]
                                   )["weights"])
    else:
        module.update(_expert_files(tag_dir))
    weights = _hf(module, saved, manifest, meta)
    missing = sorted(set(hf_shapes(meta, manifest.get("task") or "causal-lm")) - set(weights))
    if missing:
        raise UnusableInput(f"{tag_dir}: the expert-parallel checkpoint holds no {missing[:3]} of the model in "
                            f"{meta}: it is incomplete, or was written by another model")
    return weights


def autoep_moments(tag_dir: Path, manifest: dict, meta: Path) -> tuple[dict, int]:
    """({"exp_avg" / "exp_avg_sq": {HF name: tensor}}, the optimizer step) of an AutoEP checkpoint at ZeRO-0/1/2."""
    saved, steps = _model_states(tag_dir, manifest), []
    if manifest.get("zero_stage") == 3:
        def zero3_moments(opt):
            states = opt["optimizer_state_dict"]["state"]  # per group: {"step", moment: flat share}
            steps.extend(int(states[i]["step"]) for i in states)
            return {key: [states[i][key] for i in sorted(states)] for key in MOMENTS}

        found = _zero3(tag_dir, zero3_moments)
        return {key: _hf(found[key], saved, manifest, meta) for key in MOMENTS}, max(steps)
    if not partition_files(tag_dir):
        found, step = _torch_states(tag_dir, manifest)
        return {key: _hf(found[key], saved, manifest, meta) for key in MOMENTS}, step

    def moments(opt):
        states = opt["base_optimizer_state"]["state"]
        groups = [states[g] if g in states else states[list(states)[g]] for g in range(len(states))]
        steps.extend(int(state["step"]) for state in groups)
        return [{key: state[key] for key in MOMENTS} for state in groups]

    found = _partitioned(tag_dir, manifest, saved, moments)
    return {key: _hf(found[key], saved, manifest, meta) for key in MOMENTS}, max(steps)


def _partitioned(tag_dir: Path, manifest: dict, saved: dict, flats) -> dict:
    """{kind: {AutoEP name: tensor}} from the ZeRO-1/2 partition files; flats(optimizer_state_dict) gives per
    group {kind: flat tensor}. Dense tensors joined over every rank, experts per ep rank, then ep ranks in order."""
    ep, files = manifest.get("expert_parallel", 1), partition_files(tag_dir)  # (dp, 0) -> path, dp order
    shapes = dict(param_shapes(saved))  # this rank's (local) shapes: the experts' [E / ep, ...]
    pieces = {}
    for (rank, _), path in files.items():
        opt = torch_load(path).get("optimizer_state_dict") or {}
        if "param_slice_mappings" not in opt:
            raise UnusableInput(f"{path} holds no param_slice_mappings: not a ZeRO-1/2 optimizer partition")
        by_group = flats(opt)
        for kind in (by_group[0] if by_group else {}):
            for name, fragment in fragments(opt["param_slice_mappings"], [g[kind] for g in by_group]):
                owner = rank % ep if _is_expert(name) else None
                pieces.setdefault(kind, {}).setdefault(name, {}).setdefault(owner, []).append(fragment)
    out = {}
    for kind, by_name in pieces.items():
        out[kind] = {}
        for name, owners in by_name.items():
            if None in owners:
                out[kind][name] = join(owners[None]).reshape(shapes[name])
            else:
                _check_owners(name, owners, ep, tag_dir)
                out[kind][name] = _cat([join(owners[e]).reshape(shapes[name]) for e in range(ep)])
    return out


def _model_states(tag_dir: Path, manifest: dict) -> dict:
    """Rank 0's model states: the module without its experts, the config, ZeRO's param_shapes."""
    return torch_load(tag_dir / (zero3_model_states() if manifest.get("zero_stage") == 3 else model_states()))


def _zero3(tag_dir: Path, flats) -> dict:
    """ZeRO-3: {kind: {AutoEP name: tensor}} from every rank's zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt;
    flats(the optim file's optimizer_state_dict) gives {kind: [flat share per group]}. A rank's groups end to end
    hold its share of each parameter, ceil(n / ranks) elements, in param_shapes order; the dense parameters are cut
    over every rank, the experts over the rank's expert-data-parallel group (the ranks holding the same experts),
    whose ep rank and place each rank's ds_autoep_layers record. Experts then joined over the ep ranks in order."""
    files = partition_files(tag_dir)  # (rank, 0) -> path, rank order
    ranks, where, shapes, edp = [r for r, _ in files], {}, None, 1
    for r in ranks:
        saved = torch_load(tag_dir / zero3_model_states(r))
        layer = (saved.get("ds_autoep_layers") or [{}])[0]
        where[r] = (layer.get("ep_rank", 0), layer.get("expert_data_parallel_rank", 0))
        shapes, edp = shapes or param_shapes(saved), layer.get("expert_data_parallel_world_size", 1)
    ep = len(ranks) // edp
    table = zero3_table(shapes, lambda name: edp if _is_expert(name) else len(ranks))
    by_rank = {r: flats(torch_load(files[r, 0])["optimizer_state_dict"]) for r in ranks}
    holders = [sorted((r for r in ranks if where[r][0] == e), key=lambda r: where[r][1]) for e in range(ep)]
    if any(len(group) != edp for group in holders):  # ep rank e's experts: its expert-data group, in group order
        raise UnusableInput(f"{tag_dir}: the ZeRO-3 files of {len(ranks)} ranks do not make {ep} expert-data-parallel "
                            f"groups of {edp} ({holders}): the checkpoint is incomplete or from another layout")
    out = {}
    for kind in by_rank[ranks[0]]:
        out[kind] = {}
        for name, (offset, share, shape) in table.items():
            out[kind][name] = _cat([zero3_full([p for r in group for p in zero3_pieces(by_rank[r][kind], offset, share)],
                                               tuple(shape), copy=True) for group in (holders if _is_expert(name)
                                                                                      else [ranks])])
    return out


def _torch_states(tag_dir: Path, manifest: dict) -> tuple[dict, int]:
    """ZeRO-0: ({kind: {AutoEP name: moment}}, step) from each ep rank's torch optimizer state (DeepSpeed's
    expp_rank_E_mp_rank_00_optim_states.pt), state i being the i-th parameter of the optimizer's groups after
    initialize (the manifest's param_groups: dstk records them from the engine for an AutoEP run). Experts joined
    over the ep ranks in order; the dense parameters' moments are every rank's alike (ep rank 0's taken)."""
    ep, names = manifest.get("expert_parallel", 1), manifest.get("param_groups") or []
    order = [name for group in names for name in group]
    if not any(map(_is_expert, order)):
        raise UnusableInput(f"{tag_dir}: this ZeRO-0 expert-parallel checkpoint names its optimizer's parameters "
                            "before AutoEP replaced them (a dstk older than the fix); resume it on its own layout")
    by_rank, steps = [], []
    for e in range(ep):
        path = tag_dir / f"expp_rank_{e}_mp_rank_00_optim_states.pt"
        if not path.is_file():
            raise UnusableInput(f"{tag_dir}: {path.name} is missing: the ZeRO-0 checkpoint of ep {ep} is incomplete")
        states = (torch_load(path).get("optimizer") or {}).get("state") or {}
        if sorted(states) != list(range(len(order))):
            raise UnusableInput(f"{path}: {len(states)} optimizer states for the {len(order)} parameters training "
                                "recorded; resume it on its own layout")
        steps.extend(int(state["step"]) for state in states.values())
        by_rank.append({order[i]: state for i, state in states.items()})
    out = {key: {} for key in MOMENTS}
    for name in order:
        for key in MOMENTS:
            out[key][name] = _cat([r[name][key] for r in by_rank]) if _is_expert(name) else by_rank[0][name][key]
    return out, max(steps)


def _check_owners(name: str, owners: dict, ep: int, tag_dir: Path) -> None:
    if sorted(owners) != list(range(ep)):
        raise UnusableInput(f"{tag_dir}: {name} is held by ep ranks {sorted(owners)}, not all of 0..{ep - 1}: the "
                            "checkpoint is incomplete or from another layout")


def _expert_files(tag_dir: Path) -> dict:
    """{BLOCK.experts.wN: [E, ...]} from DeepSpeed's one file per expert (the module's weights)."""
    import re

    import torch

    per = {}
    for path in tag_dir.glob("layer_*_expert_*_mp_rank_00_model_states.pt"):
        for key, tensor in torch_load(path).items():
            match = re.fullmatch(r"(.+\.experts\.w[123])\.(\d+)", key)
            if match:
                per.setdefault(match.group(1), {})[int(match.group(2))] = tensor
    if not per:
        raise UnusableInput(f"{tag_dir} holds no expert files (layer_L_expert_E_*): not an AutoEP checkpoint")
    return {name: torch.stack([experts[e] for e in sorted(experts)]) for name, experts in per.items()}


def _is_expert(name: str) -> bool:
    from models.autoep import EXPERT

    return bool(EXPERT.fullmatch(name))


def _cat(tensors: list):
    import torch

    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]


def _hf(tensors: dict, saved: dict, manifest: dict, meta: Path) -> dict:
    """AutoEP's names -> the HF model's (the router's alias dropped; DeepSeek's router buffer kept)."""
    from models.autoep import ROUTER, ROUTER_BUFFER, preset_names, to_hf

    shapes = hf_shapes(meta, manifest.get("task") or "causal-lm")
    kept = {k: v for k, v in tensors.items()
            if k in shapes or ROUTER.fullmatch(k) or ROUTER_BUFFER.fullmatch(k) or _is_expert(k)}
    return to_hf(kept, preset_names(_preset(saved, meta)), shapes)


@functools.lru_cache(maxsize=4)
def hf_shapes(meta: Path, task: str) -> dict:
    """{HF name: shape} of the model in META (config.json), built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig

    from models.api import auto_class

    config = AutoConfig.from_pretrained(meta)
    with torch.device("meta"), _no_zero_init():
        model = auto_class(task, config)._from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@contextlib.contextmanager
def _no_zero_init():
    """transformers' HfDeepSpeedConfig off for the block: on a ZeRO-3 rank (a move onto ZeRO-3 reads the checkpoint
    on rank 0 alone) it is alive, and _from_config would build inside deepspeed.zero.Init, whose collectives wait
    for the other ranks forever. transformers holds it by weak reference (integrations/deepspeed.py); put back after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    live = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if live is not None:
            hf_deepspeed.set_hf_deepspeed_config(live)


def _preset(saved: dict, meta: Path) -> str:
    """The AutoEP preset the run used: its DeepSpeed config's, else the one matching the model's type."""
    import json

    from toolkit.config.rules.expert_parallel import PRESETS

    named = ((saved.get("ds_config") or {}).get("expert_parallel") or {}).get("preset_model")
    if named:
        return named
    model_type = json.loads((meta / "config.json").read_text()).get("model_type")
    found = [name for name, types in PRESETS.items() if model_type in types]
    if not found:
        raise UnusableInput(f"no AutoEP preset matches model_type {model_type!r}: dstk cannot name its experts")
    return found[0]


def onto_autoep(module, weights: dict, moments: dict) -> tuple[dict, dict]:
    """(weights, moments) by HF name -> the same with every AutoEP layer's tensors of `module` (this rank's experts,
    its router) by the layer's own names, as toolkit.checkpoint.portable.restore writes them into the engine."""
    from models.autoep import from_hf, layers, preset_names

    found = layers(module)
    weights, moments = dict(weights), {key: dict(found_) for key, found_ in moments.items()}
    shaped = {key: {hf: t.reshape(weights[hf].shape) for hf, t in tensors.items() if hf in weights}
              for key, tensors in moments.items()}
    for block, layer in found.items():
        names = preset_names(layer.model_family)
        weights.update(from_hf(weights, block, layer, names))
        for key in moments:
            moments[key].update(from_hf(shaped[key], block, layer, names))
    return weights, moments
