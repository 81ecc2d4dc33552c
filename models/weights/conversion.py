"""A checkpoint's names <-> the model's, through transformers' own conversion mapping, a layer at a time.

transformers 5 holds some weights in another form than checkpoints store them. MoE experts are fused
in memory (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)) while every hub
checkpoint has one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`, ...); some modules are renamed (`block_sparse_moe` -> `mlp`).
from_pretrained converts on load through the model's conversion mapping
(transformers.conversion_mapping.get_model_conversion_mapping: renamings and converters whose
operations, MergeModulelist, Concatenate, Transpose, ..., live in transformers.core_model_loading);
save_pretrained reverts it. dstk uses those same objects, so it follows every model type transformers
has a mapping for, with no list of its own:

    names = DiskNames(skeleton, disk_keys)    # the checkpoint's names grouped by the tensors they make
    names.sources(["model.layers.3.mlp.experts.down_proj"])   # the checkpoint names that one needs
    names.read_groups(wanted, get_tensor)     # {model name: tensor} a group at a time, reading what `wanted` needs
    to_disk(skeleton, tensors)                # model names -> save_pretrained's names and layout

Each group is converted as from_pretrained converts it (its sources in transformers' natural key order,
so expert e is row e), so a stage's parameters are bit-identical to from_pretrained's. Conversions act
within one layer (a layer's experts, a block's q/k/v), so a pipeline layer or one HF block is always a
whole group, in both directions.
"""

from __future__ import annotations

from copy import deepcopy


class Group:
    """The checkpoint tensors that make one or more model tensors: a converter (None: a plain rename)
    and its sources [(checkpoint name, the converter's pattern that matched)], in load order."""

    def __init__(self, converter, targets: list):
        self.converter, self.targets, self.sources = converter, targets, []


class DiskNames:
    """Every checkpoint name of a model directory, renamed as from_pretrained renames it.

    skeleton: the HF model (meta device is enough: names, shapes, config); disk_keys: the tensor
    names the directory's safetensors hold. `owner[model name]` is the group that makes it; names
    the model does not have are left out, as from_pretrained leaves unexpected keys."""

    def __init__(self, skeleton, disk_keys):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

        self.skeleton = skeleton
        mapping = get_model_conversion_mapping(skeleton)  # from_pretrained's: legacy renames included
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = skeleton.state_dict()  # names and shapes only
        prefix = skeleton.base_model_prefix
        groups = {}
        for key in sorted(disk_keys, key=dot_natural_key):  # experts 0..E-1 in order, as from_pretrained
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if renamed not in meta and key in meta:  # a name that should not have been renamed
                renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
            if renamed not in meta:
                continue  # not the model's (from_pretrained: unexpected)
            converter = by_pattern[pattern] if pattern is not None else None
            if renamed not in groups:
                targets = ([renamed.replace(converter.target_patterns[0], t, 1) for t in converter.target_patterns]
                           if converter is not None else [renamed])
                groups[renamed] = Group(converter, targets)
            groups[renamed].sources.append((key, pattern if pattern is not None else key))
        self.owner = {t: g for g in groups.values() for t in g.targets}
        self.converts = any(g.converter is not None or g.sources[0][0] not in g.targets for g in groups.values())

    def sources(self, names) -> list:
        """The checkpoint names the model tensors `names` are made from (those the directory has)."""
        seen = {id(g): g for n in names if (g := self.owner.get(n)) is not None}
        return [key for g in seen.values() for key, _ in g.sources]

    def read_groups(self, names, get_tensor):
        """{model name: tensor} for the `names` the directory holds, a conversion group at a time;
        get_tensor(checkpoint name) reads one stored tensor. A group is read once, whole, whichever
        of its targets are asked for."""
        names = set(names)
        seen = {id(g): g for n in names if (g := self.owner.get(n)) is not None}
        for group in seen.values():
            yield {n: t for n, t in self._convert(group, get_tensor).items() if n in names}

    def lacking(self, names) -> list:
        """The checkpoint names save_pretrained writes for the model tensors `names` that the directory does not
        hold: every name of a tensor with no source at all, and the missing members of a converted group that has
        some (one expert's tensor of a layer). Names in another (legacy) spelling count as sources."""
        meta = self.skeleton.state_dict()
        absent = [n for n in names if n not in self.owner]
        out = list(to_disk(self.skeleton, {n: meta[n] for n in absent})) if absent else []
        groups = {id(g): g for n in names if (g := self.owner.get(n)) is not None and g.converter is not None}
        for group in groups.values():
            written = to_disk(self.skeleton, {t: meta[t] for t in group.targets})
            if len(group.sources) < len(written):  # a conversion would merge too few (transformers: a size error)
                held = {key for key, _ in group.sources}
                out += [key for key in written if key not in held][:len(written) - len(group.sources)]
        return out

    def _convert(self, group: Group, get_tensor) -> dict:
        if group.converter is None:
            return {group.targets[0]: get_tensor(group.sources[0][0])}
        converter = deepcopy(group.converter)  # it collects tensors: one copy per group, as from_pretrained
        for key, pattern in group.sources:
            converter.add_tensor(group.targets[0], key, pattern, lambda key=key: get_tensor(key))  # read on use
        made = converter.convert(group.targets[0], model=self.skeleton, config=self.skeleton.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


def converts(skeleton) -> bool:
    """Whether save_pretrained writes other names or layouts than the model holds (transformers'
    conversion mapping for it, less prefix changes, which a model built in code does not revert)."""
    return bool(_saving_conversions(skeleton))


def to_disk(skeleton, tensors: dict) -> dict:
    """{model name: tensor} -> {checkpoint name: tensor} as save_pretrained writes them (fused experts
    split back per expert, renamed modules back). `tensors` must hold whole groups (a layer, a block);
    meta tensors give the names and shapes alone."""
    from transformers.core_model_loading import revert_weight_conversion

    if not _saving_conversions(skeleton):
        return dict(tensors)
    return revert_weight_conversion(skeleton, dict(tensors))


def _saving_conversions(skeleton) -> list:
    """What revert_weight_conversion applies to a model built in code (no `_weight_conversions`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [c for c in get_model_conversion_mapping(skeleton, add_legacy=False) if not isinstance(c, PrefixChange)]
