"""What a dstk checkpoint holds, by HF name: pipeline layer files, pp = 1 module states, ZeRO shards
(gathered with DeepSpeed's zero_to_fp32) and the fp32 masters of DeepSpeed's bf16/fp16 optimizers,
through the manifest dstk train saved beside them. toolkit.export.directory turns this into HF directories.
How a tag is read follows its kind (deepspeed_files.checkpoint_kind).
"""

import contextlib
import io
import math
import re
from pathlib import Path

from toolkit.errors import ConfigError, UnusableInput
from toolkit.checkpoint.deepspeed_files import (MODEL_STATES_GLOB, PARTITION_FILE, Kind, bf16_optimizer_files,
                                                checkpoint_kind, first_line, fragments, join, layer_file,
                                                model_states, param_shapes, partition_files, stage_of_model_states,
                                                torch_load, zero3_full, zero3_model_states, zero3_pieces, zero3_table)
from toolkit.checkpoint.manifest import META, hf_name_of, layer_of, read_latest, read_manifest, stage_of
from toolkit.checkpoint.run_folder import RunFolder
from models.lora.adapters import is_adapter


def find_checkpoint_dir(path) -> Path:
    """PATH when it is a checkpoint folder (it holds dstk/), or PATH/checkpoints when PATH is a run's --out."""
    path = Path(path)
    if (path / META).is_dir():
        return path
    if (RunFolder(path).checkpoints / META).is_dir():
        return RunFolder(path).checkpoints
    raise UnusableInput(f"{path} has no {META}/ folder: it was not written by dstk train; give the run's --out "
                        "folder or its checkpoints/ folder")


def tags(ckpt_dir: Path) -> list:
    """The checkpoint tags (folders) in CHECKPOINT_DIR, oldest step first."""
    def order(name):  # global_stepN by N, then any other name
        match = re.fullmatch(r"global_step(\d+)", name)
        return (0, int(match.group(1)), "") if match else (1, 0, name)

    names = [p.name for p in Path(ckpt_dir).iterdir() if p.is_dir() and p.name != META and not p.name.startswith(".")]
    return sorted(names, key=order)


def resolve_tag(ckpt_dir: Path, tag: str | None) -> str:
    """`tag`, or the one `latest` names; a message listing the tags there are when it is missing."""
    there = tags(ckpt_dir)
    listed = f"tags are {', '.join(there)}" if there else "it holds no tags"
    if tag is not None:
        if not (Path(ckpt_dir) / tag).is_dir():
            raise ConfigError(f"{ckpt_dir}: no tag {tag}; {listed}")
        return tag
    tag = read_latest(ckpt_dir)
    if tag is None or not (Path(ckpt_dir) / tag).is_dir():
        raise UnusableInput(f"{ckpt_dir} holds no complete checkpoint (no 'latest' file naming a tag directory); "
                            f"{listed}" + ("; pass --tag" if there else ""))
    return tag


def load_state_dict(ckpt_dir: Path, tag: str | None = None) -> tuple[dict, dict]:
    """(HF state dict in fp32, manifest) from any checkpoint dstk train writes."""
    ckpt_dir = Path(ckpt_dir)
    tag = resolve_tag(ckpt_dir, tag)
    manifest = read_manifest(ckpt_dir, tag)
    tag_dir = ckpt_dir / tag
    kind = checkpoint_kind(tag_dir, manifest)
    if kind is Kind.PIPELINE_TP:
        state = _pipeline_tp_state(tag_dir, manifest)
    elif kind in (Kind.PIPELINE, Kind.PIPELINE_PARTITIONED):
        state = {**_pipeline_state(tag_dir, manifest["hf_names"], manifest.get("base_saved", True)),
                 **_pipeline_masters(tag_dir, manifest, partitioned=kind is Kind.PIPELINE_PARTITIONED)}
    elif kind is Kind.TENSOR_PARALLEL:
        state = _tensor_parallel_state(tag_dir, manifest)
    elif kind is Kind.ZERO3_TENSOR_PARALLEL:
        state = _zero3_tensor_parallel_state(tag_dir, manifest)
    elif kind is Kind.BF16_OPTIMIZER:
        state = _bf16_optimizer_state(tag_dir)
    elif kind is Kind.EXPERT_PARALLEL:
        from toolkit.checkpoint.experts import autoep_weights

        state = autoep_weights(tag_dir, manifest, ckpt_dir / META)
    elif kind in (Kind.ZERO12, Kind.ZERO3):
        state = _zero_state(ckpt_dir, tag)
    else:
        state = _module_state(tag_dir, manifest)
    return {k: v.float() for k, v in state.items()}, manifest


def _module_state(tag_dir: Path, manifest: dict) -> dict:
    """pp = 1 at ZeRO-0: the module, with the FP16 wrappers' fp32 masters in place of its weights."""
    path = tag_dir / model_states()
    saved = torch_load(path)
    if not isinstance(saved, dict) or "module" not in saved:
        raise UnusableInput(f"{path} holds no 'module' state dict: not a DeepSpeed model checkpoint")
    return {**saved["module"], **zero0_masters(saved, manifest)}


def _zero_state(ckpt_dir: Path, tag: str) -> dict:
    """pp = 1 at ZeRO 1-3: the optimizer's fp32 partitions, gathered by DeepSpeed's zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as exc:
        raise UnusableInput(f"{ckpt_dir / tag}: the ZeRO shards cannot be gathered ({first_line(exc)}); "
                            "the checkpoint is incomplete or damaged: export another tag with --tag") from None
    return {**_frozen(ckpt_dir / tag), **state}  # a frozen base (LoRA) is not in the optimizer's files


def _masters(saved: dict) -> list:
    """Per parameter group {"weights": the rank's flat fp32 partition} of a ZeRO-1/2 or bf16 optimizer file."""
    return [{"weights": flat} for flat in saved["single_partition_of_fp32_groups"]]


def _bf16_optimizer_state(tag_dir: Path) -> dict:
    """The module's tensors, with BF16_Optimizer's fp32 masters (each dp rank's fragments by the module's
    names, param_slice_mappings) in place of the trained ones; a tied weight's other names
    (shared_params) get its master too."""
    saved = torch_load(tag_dir / model_states())
    module = dict(saved.get("module") or {})
    masters = partition_fragments(bf16_optimizer_files(tag_dir), _masters).get("weights", {})
    for (_, name), pieces in masters.items():
        module[name] = join(pieces).reshape(module[name].shape)
    for alias, name in (saved.get("shared_params") or {}).items():
        if (0, name) in masters and alias in module:
            module[alias] = module[name]
    return module


def _tensor_parallel_state(tag_dir: Path, manifest: dict) -> dict:
    """An AutoTP run (pp = 1, ZeRO 0-2): tp rank t wrote mp_rank_{t:02d}_model_states.pt, its shard of every
    sharded tensor; where DeepSpeed keeps fp32 masters (bf16/fp16) they replace the module's: at ZeRO-0 in
    that file's optimizer state (as at tp 1), at ZeRO-1/2 in the zero_pp_rank_{dp}_mp_rank_{t:02d} files.
    The shards are put together by the map AutoTP saved with them (universal_checkpoint_info: per tensor
    and rank, which strided pieces of the full tensor a shard holds; fused projections included);
    replicated tensors are taken from rank 0 and a padded vocabulary is cut to the model's."""
    import torch

    shards = []
    for t in range(manifest["tp"]):
        path = tag_dir / model_states(t)
        saved = torch_load(path)
        if not isinstance(saved, dict) or "module" not in saved:
            raise UnusableInput(f"{path} holds no 'module' state dict: not a DeepSpeed model checkpoint")
        shards.append({**saved["module"], **zero0_masters(saved, manifest)})
        if t == 0:
            info = saved.get("universal_checkpoint_info") or {}
    files = list(partition_files(tag_dir).values())
    if files and next(iter(shards[0].values())).dtype != torch.float32:  # bf16/fp16: the fp32 masters
        masters = partition_fragments(files, _masters)
        for (t, name), pieces in masters.get("weights", {}).items():
            if name in shards[t]:
                shards[t][name] = join(pieces).reshape(shards[t][name].shape)
    return merge_tp_shards(shards, info)


def _zero3_tensor_parallel_state(tag_dir: Path, manifest: dict) -> dict:
    """AutoTP under ZeRO-3: dp x tp ranks, global rank g = d * tp + t. Rank (d, t)'s partition file
    (zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt) holds its ZeRO-3 share of each fp32 master, in the
    param_shapes order of tp rank t's model states, groups end to end. Two kinds of tensor:
      a tp shard (a sharded projection): cut over its tp rank's dp ranks, ceil(n / dp) elements each;
      a tensor the tp ranks share (AutoTP's tp_replicated_parameter_patterns: embedding, norms): cut by
        zero.Init over the whole world, ceil(n / (dp x tp)) each, in global rank order; AutoTP's map
        records no shape for it, and it is gathered once.
    The shards, gathered per tp rank, are then merged (merge_tp_shards)."""
    tp, files = manifest["tp"], partition_files(tag_dir)  # (d, t) -> path
    dp = 1 + max((d for d, _ in files), default=-1)
    if sorted(files) != [(d, t) for d in range(dp) for t in range(tp)]:
        raise UnusableInput(f"{tag_dir}: the ZeRO-3 files of {dp} dp x {tp} tp ranks are not all there (found "
                            f"{len(files)}); the checkpoint is incomplete: export another tag with --tag")
    flats = {rank: torch_load(path)["optimizer_state_dict"]["fp32_flat_groups"] for rank, path in files.items()}
    models = [torch_load(tag_dir / zero3_model_states(0, t)) for t in range(tp)]
    info = models[0].get("universal_checkpoint_info") or {}
    patterns = [re.compile(p) for p in info.get("tp_replicated_parameter_patterns") or []]

    def shared(name: str) -> bool:
        return any(p.match(name) for p in patterns)

    # per tp rank: name -> (offset, share, shape) in each of its ranks' partitions (a shard's size may differ by t)
    tables = [zero3_table(param_shapes(saved), lambda name: dp * tp if shared(name) else dp) for saved in models]

    def gather(name: str, ranks: list):  # the tensor from its shares on `ranks` [(d, t)], in that order
        pieces = [piece for d, t in ranks for piece in zero3_pieces(flats[d, t], *tables[t][name][:2])]
        return zero3_full(pieces, tables[ranks[0][1]][name][2])

    world = [(g // tp, g % tp) for g in range(dp * tp)]
    whole = {name: gather(name, world) for name in tables[0] if shared(name)}
    shards = [{name: gather(name, [(d, t) for d in range(dp)]) for name in table if not shared(name)}
              for t, table in enumerate(tables)]
    merged = merge_tp_shards(shards, {**info, "tp_replicated_parameter_patterns": []})
    return {**whole, **merged}


def merge_tp_shards(shards: list, info: dict) -> dict:
    """Full tensors from AutoTP's shards (one state dict per tp rank) through its universal_checkpoint_info.
    A name AutoTP neither mapped nor replicated is a tied copy (lm_head.weight of a tied model, one
    tensor with the embedding in training): left out, HF ties it again on load."""
    import torch

    mapped = (info.get("affine_map") or {}).get("params") or {}
    if not mapped:
        raise UnusableInput("the tensor-parallel checkpoint carries no AutoTP map of its shards "
                            "(universal_checkpoint_info.affine_map); it was not written by DeepSpeed >= 0.19's AutoTP")
    replicated = [re.compile(p) for p in info.get("tp_replicated_parameter_patterns") or []]
    vocabulary = [re.compile(p) for p in info.get("vocabulary_parameter_patterns") or []]
    out = {}
    for name, first in shards[0].items():
        spec = next((v for p, v in mapped.items() if re.match(p, name)), None)
        if spec is None:
            if any(p.match(name) for p in replicated):
                out[name] = first
            continue  # export's check names anything missing
        full = torch.empty(spec["logical_shape"], dtype=first.dtype)
        covered = torch.zeros(spec["logical_shape"], dtype=torch.bool)
        for rank, where in spec["ranks"].items():
            shard = shards[int(rank)][name].contiguous()
            at = shard.storage_offset()  # saved tensors may be views into one flat buffer (ZeRO-1/2)
            for piece in where["pieces"]:
                (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
                part = shard.as_strided(piece["shape"], dst_strides, at + dst)  # shard = full x scale
                full.as_strided(piece["shape"], src_strides, src).copy_(part / piece.get("scale", 1))
                covered.as_strided(piece["shape"], src_strides, src).fill_(True)
        if not covered.all():
            raise UnusableInput(f"AutoTP's map of {name} leaves {int((~covered).sum())} of its elements in no shard; "
                                "the checkpoint cannot be merged")
        if info.get("original_vocab_size") and any(p.match(name) for p in vocabulary):
            full = full[: info["original_vocab_size"]]
        out[name] = full
    return out


def _frozen(tag_dir: Path) -> dict:
    """The module's own tensors at pp = 1 (frozen parameters are not in ZeRO's optimizer files; under
    ZeRO-3 the module holds empty placeholders, which are left out)."""
    path = tag_dir / model_states()
    saved = torch_load(path) if path.exists() else {}
    return {k: v for k, v in (saved.get("module") or {}).items() if v.numel()}


def zero0_masters(saved: dict, manifest: dict) -> dict:
    """ZeRO-0 under bf16/fp16: the fp32 masters DeepSpeed's optimizer wrapper keeps, by name, in the
    optimizer's parameter order that training recorded (manifest["param_groups"]): one tensor per
    parameter ("fp32_groups", FP16_UnfusedOptimizer: torch's AdamW) or one flat tensor per group
    ("fp32_groups_flat", FP16_Optimizer: FusedAdam on CUDA). {} without masters (fp32 training: the
    module's weights are the masters); a checkpoint that does not match the recorded order is refused."""
    optimizer = saved.get("optimizer") if isinstance(saved.get("optimizer"), dict) else {}
    names = manifest.get("param_groups")
    groups = optimizer.get("fp32_groups")
    if groups is None and optimizer.get("fp32_groups_flat") is not None:
        groups = [_split(flat, [saved["module"][n].numel() for n in group_names])
                  for flat, group_names in zip(optimizer["fp32_groups_flat"], names or [])]
    if not groups or not names:
        return {}
    if [len(g) for g in groups] != [len(n) for n in names]:
        raise UnusableInput(f"the checkpoint's fp32 masters ({[len(g) for g in groups]} per group) do not match the "
                            f"parameter order training recorded ({[len(n) for n in names]}); export with --tag "
                            "another checkpoint of this run")
    return {name: master for group, group_names in zip(groups, names) for name, master in zip(group_names, group)}


def _split(flat, numels: list) -> list:
    """A flat fp32 group cut into its parameters (padding past their sum is dropped)."""
    if sum(numels) > flat.numel():
        return []
    return list(flat[: sum(numels)].split(numels))


def _pipeline_tp_state(tag_dir: Path, manifest: dict) -> dict:
    """Pipeline stages sharded over tp (toolkit.distributed.tensor_parallel): tp rank t of each stage wrote
    layer_XX-model_{t:02d}-model_states.pt, and (dp rank 0) mp_rank_{stage * tp + t:02d}_model_states.pt with
    the map AutoTP made of that stage's shards. Each rank's layers are read by HF name as at tp 1 (bf16:
    with its fp32 masters), the stages' maps joined, and the shards merged as at pp 1 (merge_tp_shards);
    what the map does not name (embedding, final norm, head) every tp rank holds whole: rank 0's is taken."""
    tp = manifest["tp"]
    info = {}
    for path in sorted(tag_dir.glob(MODEL_STATES_GLOB)):
        for key, value in (torch_load(path).get("universal_checkpoint_info") or {}).items():
            if key == "affine_map":
                info.setdefault(key, {}).setdefault("params", {}).update(value.get("params") or {})
            elif isinstance(value, list):
                info[key] = info.get(key, []) + value
            else:
                info.setdefault(key, value)
    masters = _pipeline_fragments(tag_dir)
    shards = []
    for t in range(tp):
        shard = _pipeline_state(tag_dir, manifest["hf_names"], manifest.get("base_saved", True), t)
        mine = {(mp // tp, name): pieces for (mp, name), pieces in masters.items() if mp % tp == t}
        for name, flat in masters_by_hf_name(mine, manifest).items():
            if name in shard:
                shard[name] = flat.reshape(shard[name].shape)
        shards.append(shard)
    return {**shards[0], **merge_tp_shards(shards, info)}


def _pipeline_state(tag_dir: Path, hf_names: list, base_saved: bool = True, tp_rank: int | None = None) -> dict:
    """layer_XX-model_states.pt (keys relative to the layer) -> HF names via the manifest.

    hf_names[i] is {key in that layer's state dict: HF parameter name}. base_saved False (LoRA from a
    directory): a layer without adapters has no file, and the others hold their adapters only.
    tp_rank: tp rank t's files (tp inside the stages)."""
    state = {}
    for i, names in enumerate(hf_names):
        path = tag_dir / layer_file(i, tp_rank)
        if not names or (not path.exists() and set(names.values()) <= set(state)):
            continue  # DeepSpeed saves a tied module once, with its first layer
        if not path.exists() and not base_saved and not any(is_adapter(hf) for hf in names.values()):
            continue
        layer = torch_load(path)
        for key, hf in names.items():
            if key in layer:  # a LoRA run's layer files may hold its adapters only
                state[hf] = layer[key]
    return state


def _pipeline_masters(tag_dir: Path, manifest: dict, partitioned: bool) -> dict:
    """A pipeline trained in bf16/fp16: the fp32 masters, by HF name ({} when there are none: in fp32 the
    weights are the masters). partitioned: in ZeRO-1 / BF16_Optimizer files, else each stage's mp_rank file."""
    pieces = _pipeline_fragments(tag_dir) if partitioned else _pipeline_zero0_fragments(tag_dir)
    return masters_by_hf_name(pieces, manifest)


def _pipeline_fragments(tag_dir: Path) -> dict:
    """{(mp rank, stage-module name): fp32 master fragments} from the optimizer's partition files: BF16_Optimizer's
    (bf16_zero_pp_rank_*) and ZeRO-1's (zero_pp_rank_*: fp16, or bf16 accumulating in bf16); {} without such
    files. The mp rank is the stage (stage * tp + tp rank with tp inside the stages)."""
    files = list(partition_files(tag_dir).values())
    if not files:
        return {}
    return partition_fragments(files, _masters)["weights"]


def _pipeline_zero0_fragments(tag_dir: Path) -> dict:
    """fp16 at ZeRO-0: FP16_UnfusedOptimizer's masters (one per parameter, "fp32_groups"; torch's AdamW) or
    FP16_Optimizer's (one flat tensor per group, "fp32_groups_flat"; FusedAdam), in each stage's mp_rank file,
    named by the param_names training saved beside them (checkpoint.save) and cut by DeepSpeed's
    param_shapes. {} where a stage holds none (fp32: its weights are the masters)."""
    pieces = {}
    for path in sorted(tag_dir.glob(MODEL_STATES_GLOB)):
        pieces.update(zero0_stage_masters(path))
    return pieces


def zero0_stage_masters(path: Path, mmap: bool = False) -> dict:
    """{(stage, stage-module name): [flat fp32 master]} from one stage's mp_rank_XX_model_states.pt under
    FP16_(Unfused)Optimizer; {} when it holds none."""
    saved = torch_load(path, mmap=mmap)
    optimizer = saved.get("optimizer") if isinstance(saved.get("optimizer"), dict) else {}
    names, groups = saved.get("param_names"), optimizer.get("fp32_groups")
    if groups is None and optimizer.get("fp32_groups_flat") is not None:
        numels = [[math.prod(shape) for shape in group.values()] for group in saved.get("param_shapes") or []]
        groups = [_split(flat, n) for flat, n in zip(optimizer["fp32_groups_flat"], numels)]
    if not groups or not names or [len(g) for g in groups] != [len(n) for n in names]:
        return {}
    stage = stage_of_model_states(path)
    return {(stage, name): [master.reshape(-1)] for group, group_names in zip(groups, names)
            for name, master in zip(group_names, group)}


def partition_fragments(files: list, flats) -> dict:
    """ZeRO-1/2 and bf16 optimizer files: dp rank r of stage s wrote ...zero_pp_rank_{r}_mp_rank_{s:02d}_
    optim_states.pt, holding per parameter group a flat fp32 partition (r's share of the group) and
    param_slice_mappings: stage-module name ("3.layer.mlp.down_proj.weight", "tied_modules.embed.parts.
    0.weight", or the HF name at pp = 1) -> where its fragment starts in that partition.
    flats(the file's optimizer_state_dict) gives per group {kind: flat tensor} (the masters, a moment);
    returns {kind: {(stage, name): [fragments in dp-rank order]}} (a parameter's fragments, joined, are
    its flat tensor)."""
    pieces = {}
    ranks = {path: tuple(map(int, PARTITION_FILE.fullmatch(path.name).groups())) for path in files}  # (dp, mp)
    for path in sorted(files, key=lambda p: ranks[p][::-1]):
        stage = ranks[path][1]
        saved = torch_load(path).get("optimizer_state_dict") or {}
        if "param_slice_mappings" not in saved:
            raise UnusableInput(f"{path} holds no param_slice_mappings: not a ZeRO-1/2 or bf16 optimizer partition")
        by_group = flats(saved)  # per group {kind: flat}
        for kind in (by_group[0] if by_group else {}):
            found = fragments(saved["param_slice_mappings"], [group[kind] for group in by_group])
            for name, fragment in found:
                pieces.setdefault(kind, {}).setdefault((stage, name), []).append(fragment)
    return pieces


def masters_by_hf_name(pieces: dict, manifest: dict) -> dict:
    """{(stage, stage-module name): fragments} -> {HF name: flat fp32 tensor}. A tied module's copy is
    taken from the first layer that holds it (the same stage whose layer file export reads)."""
    out = {}
    for (stage, name), fragments_of_name in pieces.items():
        found = layer_of(name, manifest)
        if found is None:
            continue
        if name.startswith("tied_modules.") and stage_of(manifest, found[0]) != stage:
            continue  # a later stage's copy of the tied weight
        hf = hf_name_of(name, manifest)
        if hf is not None:
            out[hf] = join(fragments_of_name)
    return out
