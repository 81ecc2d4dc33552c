"""A dstk checkpoint's tensors by HF name, about one layer at a time: what toolkit.export.stream writes.

A reader knows the HF names it holds before it reads a tensor (`names()`), then yields them in
groups (`groups()`: {HF name: tensor}): one pipeline layer file, or at pp = 1 the tensors of one HF
block (model.layers.3.*). Every group opens its files again with torch.load(mmap=True) and drops
them after: the pages read for a group are unmapped with it, so the resident set stays near one
group's bytes whatever the model's size. The values are those state.load_state_dict
gives (fp32 masters where the checkpoint holds them), before any cast.

`alias` maps each tensor name of the HF model to the one it is saved under (a tied weight's copy,
lm_head.weight -> the embedding's name): a master found under either name wins.
"""

import re
from pathlib import Path

from toolkit.errors import UnusableInput
from toolkit.checkpoint.deepspeed_files import (Kind, checkpoint_kind, fragments, join, layer_file, model_states,
                                                natural_order, optim_files, param_shapes, partition_files,
                                                torch_load, zero3_full, zero3_pieces, zero3_table)
from toolkit.checkpoint.manifest import layer_of, stage_of
from toolkit.checkpoint.state import masters_by_hf_name, zero0_masters, zero0_stage_masters


class NotStreamable(Exception):
    """A checkpoint this module cannot read tensor by tensor (export then loads it whole)."""


def open_reader(tag_dir: Path, manifest: dict, alias: dict):
    """The reader for this checkpoint's kind: pipeline, pp = 1 ZeRO 1-2 or 3, or pp = 1 module."""
    kind = checkpoint_kind(tag_dir, manifest)
    if kind in (Kind.PIPELINE_TP, Kind.TENSOR_PARALLEL, Kind.ZERO3_TENSOR_PARALLEL):
        raise NotStreamable("tensor-parallel shards are merged whole (state.merge_tp_shards)")
    if kind is Kind.EXPERT_PARALLEL:
        raise NotStreamable("AutoEP's experts are joined whole from their ep ranks (checkpoint.experts)")
    if kind in (Kind.PIPELINE, Kind.PIPELINE_PARTITIONED):
        return PipelineReader(tag_dir, manifest, alias)
    if kind is Kind.MODULE:
        return ModuleReader(tag_dir, manifest, alias)
    return (Zero3Reader if kind is Kind.ZERO3 else Zero12Reader)(tag_dir, optim_files(tag_dir), alias)


def _load(path: Path):
    return torch_load(path, mmap=True)


def block_groups(names) -> list:
    """Consecutive names of one HF block (the part up to the first number: model.layers.3) together;
    the names outside blocks (embeddings, final norm, head) in runs of their own."""
    groups, last = [], object()
    for name in names:
        match = re.match(r"(.*?\.\d+)\.", name)
        key = match.group(1) if match else None
        if not groups or key != last:
            groups.append([])
        groups[-1].append(name)
        last = key
    return groups


class PipelineReader:
    """layer_XX-model_states.pt one at a time (+ that layer's bf16/fp16 masters from its stage's files)."""

    def __init__(self, tag_dir: Path, manifest: dict, alias: dict):
        self.tag_dir, self.manifest, self.alias = tag_dir, manifest, alias
        self.masters = {}  # stage -> [optimizer partition files (BF16_Optimizer's or ZeRO-1's), in dp-rank order]
        for (_, stage), path in partition_files(tag_dir).items():
            self.masters.setdefault(stage, []).append(path)

    def names(self) -> list:
        hf_names = (hf for names in self.manifest["hf_names"] for hf in names.values())
        return list(dict.fromkeys(self.alias.get(hf, hf) for hf in hf_names))

    def groups(self):
        done = set()
        for i, names in enumerate(self.manifest["hf_names"]):
            todo = {k: hf for k, hf in names.items() if self.alias.get(hf, hf) not in done}
            if not todo:
                continue  # DeepSpeed saves a tied module once, with its first layer
            layer = _load(self.tag_dir / layer_file(i))
            masters = {self.alias.get(hf, hf): t for hf, t in self._layer_masters(i).items()}
            group = {}
            for key, hf in todo.items():
                name = self.alias.get(hf, hf)
                if name in masters or key in layer:
                    group[name] = masters.get(name, layer.get(key))
            del layer
            done.update(group)
            yield group

    def _layer_masters(self, index: int) -> dict:
        """Layer `index`'s fp32 masters by HF name (flat), from the files of the stage holding it."""
        stage = stage_of(self.manifest, index)
        if stage is None:
            return {}

        def mine(name):  # a stage-module name of layer `index` (a tied module's: its first layer's)
            found = layer_of(name, self.manifest)
            return found is not None and found[0] == index

        if stage not in self.masters:  # fp16 at ZeRO-0: the wrapper's masters in the stage's mp_rank file
            path = self.tag_dir / model_states(stage)
            found = zero0_stage_masters(path, mmap=True) if path.is_file() else {}
            return masters_by_hf_name({key: v for key, v in found.items() if mine(key[1])}, self.manifest)
        pieces = {}
        for path in self.masters[stage]:
            saved = _load(path)["optimizer_state_dict"]
            found = fragments(saved["param_slice_mappings"], saved["single_partition_of_fp32_groups"], mine)
            for name, fragment in found:
                pieces.setdefault((stage, name), []).append(fragment)
            del saved
        return masters_by_hf_name(pieces, self.manifest)


class ModuleReader:
    """pp = 1 without ZeRO files: mp_rank_00_model_states.pt's module (+ ZeRO-0's fp32 masters in it)."""

    def __init__(self, tag_dir: Path, manifest: dict, alias: dict):
        self.path, self.manifest, self.alias = tag_dir / model_states(), manifest, alias
        saved = _load(self.path)
        if not isinstance(saved, dict) or "module" not in saved:
            raise UnusableInput(f"{self.path} holds no 'module' state dict: not a DeepSpeed model checkpoint")
        self._names = list(saved["module"]) + list(zero0_masters(saved, manifest))

    def names(self) -> list:
        return list(dict.fromkeys(self.alias.get(n, n) for n in self._names))

    def groups(self):
        done = set()
        for names in block_groups(self._names):
            saved = _load(self.path)
            masters = {self.alias.get(n, n): t for n, t in zero0_masters(saved, self.manifest).items()}
            group = {}
            for n in names:
                name = self.alias.get(n, n)
                if name not in done and name not in group:
                    group[name] = masters[name] if name in masters else saved["module"][n]
            del saved, masters
            done.update(group)
            yield group


class ZeroReader:
    """pp = 1 under ZeRO: the model states file(s) name the parameters and hold the buffers; each
    rank's optimizer file holds its partition of the fp32 masters. A subclass says where a parameter's
    pieces lie in those partitions (`_master`)."""

    def __init__(self, tag_dir: Path, optim: list, alias: dict, model_glob: str = "*_model_states.pt"):
        self.optim, self.alias = optim, alias
        model_files = sorted(tag_dir.glob(model_glob), key=natural_order)
        if not model_files:
            raise UnusableInput(f"{tag_dir} holds ZeRO optimizer files but no *_model_states.pt: the checkpoint is "
                                "incomplete; export another tag with --tag")
        self.model_file = model_files[0]
        saved = _load(self.model_file)
        opt = _load(optim[0])["optimizer_state_dict"]
        count = opt.get("partition_count")
        self.world = max(count) if isinstance(count, list) else count
        if self.world != len(optim):
            raise UnusableInput(f"{tag_dir}: the ZeRO shards cannot be gathered (expected {self.world} "
                                f"*_optim_states.pt files, found {len(optim)}); the checkpoint is incomplete or "
                                "damaged: export another tag with --tag")
        self.shapes = dict(param_shapes(saved))  # trainable: name -> shape, in partition order
        self.frozen = list(saved.get("frozen_param_shapes") or {})
        self.module = [k for k, v in saved["module"].items() if v.numel()]  # ZeRO-3: empty placeholders
        self.shared = dict(saved.get("shared_params") or {})  # a tied weight's other name -> the one it is saved as

    def names(self) -> list:
        trainable = list(self.shapes)
        every = self.module + trainable + self.frozen + [a for a, b in self.shared.items() if b in trainable]
        return list(dict.fromkeys(self.alias.get(n, n) for n in every))

    def groups(self):
        """One HF block at a time ({HF name: tensor}); the files are mapped again for each block and let go
        after it, so only that block's pages are ever resident."""
        order = list(dict.fromkeys(self.module + list(self.shapes) + self.frozen))
        done = set()
        for names in block_groups(order):
            saved = _load(self.model_file)
            flats = [self._flat_groups(_load(path)["optimizer_state_dict"]) for path in self.optim]  # [rank][group]
            group = {}
            for n in names:
                name = self.alias.get(n, n)
                if name in done or name in group:
                    continue  # a tied weight's second name: written once
                value = self._value(n, name, saved, flats)
                if value is not None:
                    group[name] = value
            del saved, flats
            done.update(group)
            yield group

    def _value(self, n: str, name: str, saved: dict, flats: list):
        """Tensor `n` (HF name `name`): its fp32 master, found under its own name, the name it is tied to, or
        its HF name; else a frozen parameter's saved fragment; else the module's own (buffers); None if none."""
        for candidate in (n, self.shared.get(n), name):
            master = self._master(candidate, flats) if candidate else None
            if master is not None:
                return master
        if n in self.frozen:
            frozen = (saved.get("frozen_param_fragments") or {}).get(n)
            if frozen is not None:
                return frozen
        return saved["module"].get(n)


class Zero12Reader(ZeroReader):
    """ZeRO 1-2 (and BF16_Optimizer): each rank's partition file says where its fragment of every parameter
    lies (param_slice_mappings); a parameter is its fragments, in rank order, joined."""

    def __init__(self, tag_dir: Path, optim: list, alias: dict):
        super().__init__(tag_dir, optim, alias)
        self.mappings = [_load(path)["optimizer_state_dict"]["param_slice_mappings"] for path in optim]  # [rank][group]

    @staticmethod
    def _flat_groups(opt: dict) -> list:
        return opt["single_partition_of_fp32_groups"]

    def _master(self, name: str, flats: list):
        if name not in self.shapes:
            return None
        parts = [fragment for mappings, rank_flats in zip(self.mappings, flats)
                 for _, fragment in fragments(mappings, rank_flats, (name,))]
        return join(parts, copy=True).view(self.shapes[name])


class Zero3Reader(ZeroReader):
    """ZeRO-3: every parameter is cut in `world` equal shares (the last padded), rank r's share lying
    at the same offset of r's groups laid end to end (deepspeed_files.zero3_table)."""

    def __init__(self, tag_dir: Path, optim: list, alias: dict, model_glob: str = "*_model_states.pt"):
        super().__init__(tag_dir, optim, alias, model_glob)
        if self.frozen:
            raise NotStreamable("frozen parameters under ZeRO-3")
        self.where = zero3_table(self.shapes.items(), self.world)  # name -> (offset, share, shape)

    @staticmethod
    def _flat_groups(opt: dict) -> list:
        return opt["fp32_flat_groups"]

    def _master(self, name: str, flats: list):
        if name not in self.where:
            return None
        offset, share, shape = self.where[name]
        pieces = [piece for rank_flats in flats for piece in zero3_pieces(rank_flats, offset, share)]
        return zero3_full(pieces, shape, copy=True)
