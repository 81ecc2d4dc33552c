"""An expert-parallel run's checkpoint (DeepSpeed 0.19.8's AutoEP) by HF name: its weights and Adam moments.

AutoEP replaces each MoE block with its own layer (models.autoep): ep consecutive ranks each hold E / ep of every
block's experts as experts.w1/w2/w3 [E / ep, ...]. What DeepSpeed writes (runtime/engine.py _save_moe_checkpoint),
per pipeline stage S (00 at pp 1; inside stages the names are the stage's, "1.layer.mlp.experts.w1", and L restarts
at 0 in every stage):
  mp_rank_S_model_states.pt      the module without the experts (the router as router.gate.weight)
  layer_L_expert_E_mp_rank_S_model_states.pt   expert E of MoE block L: {BLOCK.experts.wN.E: [I, H] / [H, I]}
  zero_pp_rank_R_mp_rank_S_optim_states.pt     ZeRO-1/2: rank R's partitions. The dense groups cut over all dp
      ranks; the expert groups over R's expert-data-parallel group (the ranks holding the same experts, R % ep = e,
      in rank order), whose joined fragments are ep rank e's experts.wN [E / ep, ...].
  expp_rank_E_mp_rank_00_optim_states.pt       ZeRO-0: ep rank E's torch optimizer state, in the engine's order
      after initialize (the manifest's param_groups)
  ZeRO-3: each rank's zero_pp_rank_R files, each expert in ZeRO-3 shares of its expert-data-parallel group (_zero3).
Here they become the fp32 masters and moments of the HF model's own tensors (every expert, fused as transformers
holds them), by models.autoep.to_hf; `onto_autoep` cuts them back into an AutoEP engine's (a move onto ep at pp 1).
"""
from pathlib import Path

from models.autoep import hf_shapes
from toolkit.checkpoint.deepspeed_files import (fragments, join, model_states, param_shapes, partition_files,
                                                torch_load, zero3_full, zero3_model_states, zero3_pieces, zero3_table)
from toolkit.errors import UnusableInput

MOMENTS = ("exp_avg", "exp_avg_sq")


def autoep_weights(tag_dir: Path, manifest: dict, meta: Path) -> dict:
    """{HF name: fp32 master} of an AutoEP checkpoint (meta: the run's dstk/ folder, config.json)."""
    saved, module = _model_states(tag_dir, manifest), {}
    for stage in range(manifest.get("pp", 1)):  # each pipeline stage's own files, its MoE layers numbered from 0
        own = torch_load(tag_dir / model_states(stage)) if stage else saved
        found = {k: v for k, v in (own.get("module") or {}).items() if v.numel()}  # ZeRO-3: its buffers alone
        if manifest.get("zero_stage") == 3:
            found.update(_zero3(tag_dir, lambda opt: {"weights": list(opt["fp32_flat_groups"])})["weights"])
        elif partition_files(tag_dir):
            found.update(_partitioned(tag_dir, manifest, own, lambda opt: [
                {"weights": f} for f in opt["single_partition_of_fp32_groups"]], stage)["weights"])
        else:
            found.update(_expert_files(tag_dir, stage))
        module.update(_stage_names(found, manifest))
    weights = _hf(module, saved, manifest, meta)
    missing = sorted(set(hf_shapes(meta, manifest.get("task") or "causal-lm")) - set(weights))
    if missing:
        raise UnusableInput(f"{tag_dir}: the expert-parallel checkpoint holds no {missing[:3]} of the model in "
                            f"{meta}: it is incomplete, or was written by another model")
    return weights


def autoep_moments(tag_dir: Path, manifest: dict, meta: Path) -> tuple[dict, int]:
    """({"exp_avg" / "exp_avg_sq": {HF name: tensor}}, the optimizer step) of an AutoEP checkpoint at ZeRO-0/1/2
    (and ZeRO-1 inside pipeline stages), or ZeRO-3."""
    saved, steps = _model_states(tag_dir, manifest), []
    if manifest.get("zero_stage") == 3:
        def zero3_moments(opt):
            states = opt["optimizer_state_dict"]["state"]  # per group: {"step", moment: flat share}
            steps.extend(int(states[i]["step"]) for i in states)
            return {key: [states[i][key] for i in sorted(states)] for key in MOMENTS}

        found = _zero3(tag_dir, zero3_moments)
        return {key: _hf(found[key], saved, manifest, meta) for key in MOMENTS}, max(steps)
    if not partition_files(tag_dir):
        found = {key: {} for key in MOMENTS}
        for stage in range(manifest.get("pp", 1)):
            names = (torch_load(tag_dir / model_states(stage)).get("param_names") if stage or manifest.get("pp", 1) > 1
                     else manifest.get("param_groups"))
            torch_states, step = _torch_states(tag_dir, manifest, names or [], stage)
            for key in MOMENTS:
                found[key].update(_stage_names(torch_states[key], manifest))
            steps.append(step)
        return {key: _hf(found[key], saved, manifest, meta) for key in MOMENTS}, max(steps)

    def moments(opt):
        states = opt["base_optimizer_state"]["state"]
        groups = [states[g] if g in states else states[list(states)[g]] for g in range(len(states))]
        steps.extend(int(state["step"]) for state in groups)
        return [{key: state[key] for key in MOMENTS} for state in groups]

    found = {key: {} for key in MOMENTS}
    for stage in range(manifest.get("pp", 1)):
        own = torch_load(tag_dir / model_states(stage)) if stage else saved
        for key, tensors in _partitioned(tag_dir, manifest, own, moments, stage).items():
            found[key].update(_stage_names(tensors, manifest))
    return {key: _hf(found[key], saved, manifest, meta) for key in MOMENTS}, max(steps)


def _stage_names(tensors: dict, manifest: dict) -> dict:
    """Inside pipeline stages, {a stage's name: tensor} -> {HF name: tensor} (stage_hf_name); what neither names
    (AutoEP's router alias) is dropped. pp 1: the names are already these."""
    if manifest.get("pp", 1) == 1:
        return tensors
    named = {stage_hf_name(name, manifest): tensor for name, tensor in tensors.items()}
    return {hf: tensor for hf, tensor in named.items() if hf is not None}


def stage_hf_name(name: str, manifest: dict) -> str | None:
    """A pipeline stage's parameter name ("<layer>.<key>") -> its HF name (manifest.hf_name_of), or for AutoEP's own
    tensors ("1.layer.mlp.experts.w1") the HF name of their block with AutoEP's tail ("model.layers.0.mlp.experts.w1"),
    the block's found from any key of the layer's map under it; None where neither names it."""
    from models.autoep import EXPERT, ROUTER, ROUTER_BUFFER

    from toolkit.checkpoint.manifest import hf_name_of, layer_of

    hf = hf_name_of(name, manifest)
    index, key = layer_of(name, manifest) or (None, "")
    match = EXPERT.fullmatch(key) or ROUTER.fullmatch(key) or ROUTER_BUFFER.fullmatch(key)
    if hf is not None or not match:
        return hf
    block = match.group(1)
    return next((v[: len(v) - len(k) + len(block)] + key[len(block):] for k, v in manifest["hf_names"][index].items()
                 if k.startswith(block + ".") and v.endswith(k[len(block):])), None)


def _partitioned(tag_dir: Path, manifest: dict, saved: dict, flats, stage: int = 0) -> dict:
    """{kind: {AutoEP name: tensor}} from the ZeRO-1/2 partition files; flats(optimizer_state_dict) gives per
    group {kind: flat tensor}. Dense tensors joined over every rank, experts per ep rank, then ep ranks in order."""
    ep = manifest.get("expert_parallel", 1)
    files = {key: path for key, path in partition_files(tag_dir).items() if key[1] == stage}  # (dp, stage): dp order
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


def _torch_states(tag_dir: Path, manifest: dict, names: list, stage: int = 0) -> tuple[dict, int]:
    """ZeRO-0: ({kind: {AutoEP name: moment}}, step) from each ep rank's torch optimizer state (DeepSpeed's
    expp_rank_E_mp_rank_S_optim_states.pt), state i being the i-th parameter of the optimizer's groups after
    initialize (`names`: the manifest's param_groups at pp 1, a stage's param_names inside pipeline stages; dstk
    records them from the engine for an AutoEP run). Experts joined over the ep ranks in order; the dense
    parameters' moments are every rank's alike (ep rank 0's taken)."""
    ep = manifest.get("expert_parallel", 1)
    order = [name for group in names for name in group]
    if not any(map(_is_expert, order)):
        raise UnusableInput(f"{tag_dir}: this ZeRO-0 expert-parallel checkpoint names its optimizer's parameters "
                            "before AutoEP replaced them (a dstk older than the fix); resume it on its own layout")
    by_rank, steps = [], []
    for e in range(ep):
        path = tag_dir / f"expp_rank_{e}_mp_rank_{stage:02d}_optim_states.pt"
        if not path.is_file():
            raise UnusableInput(f"{tag_dir}: {path.name} is missing: the ZeRO-0 checkpoint of ep {ep} is incomplete")
        optimizer = torch_load(path).get("optimizer") or {}
        states, sizes = optimizer.get("state") or {}, [len(g["params"]) for g in optimizer.get("param_groups") or []]
        if sorted(states) != list(range(len(order))) or sizes != [len(group) for group in names]:
            raise UnusableInput(f"{path}: optimizer groups of {sizes} parameters, not the {[len(g) for g in names]} "
                                "training recorded (names taken before DeepSpeed split the groups: an older dstk); "
                                "resume it on its own layout")
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


def _expert_files(tag_dir: Path, stage: int = 0) -> dict:
    """{BLOCK.experts.wN: [E, ...]} from DeepSpeed's one file per expert (the module's weights)."""
    import re

    import torch

    per = {}
    for path in tag_dir.glob(f"layer_*_expert_*_mp_rank_{stage:02d}_model_states.pt"):
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


def onto_autoep(module, weights: dict, moments: dict, names: dict) -> tuple[dict, dict]:
    """(weights, moments) by HF name -> the same with every AutoEP layer's tensors of `module` (this rank's experts,
    its router) under the layer's block's HF name ("model.layers.0.mlp.experts.w1"), as toolkit.checkpoint.portable.
    restore writes them into the engine; `names` ({parameter: HF name}, portable.hf_names_of) gives each block's HF
    name from its router's (inside pipeline stages a block is "1.layer.mlp")."""
    from models.autoep import from_hf, layers, preset_names

    found = layers(module)
    weights, moments = dict(weights), {key: dict(found_) for key, found_ in moments.items()}
    shaped = {key: {hf: t.reshape(weights[hf].shape) for hf, t in tensors.items() if hf in weights}
              for key, tensors in moments.items()}
    for block, layer in found.items():
        hf_block = names.get(layer.router.gate.weight, f"{block}.router.gate.weight").removesuffix(".router.gate.weight")
        preset = preset_names(layer.model_family)
        weights.update(from_hf(weights, hf_block, layer, preset))
        for key in moments:
            moments[key].update(from_hf(shaped[key], hf_block, layer, preset))
    return weights, moments
