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

import math
import re
from pathlib import Path

from toolkit.errors import UnusableInput
from toolkit.checkpoint.state import PARTITION_FILE, masters_by_hf_name, torch_load, zero0_masters, zero0_stage_masters


class NotStreamable(Exception):
    """A checkpoint this module cannot read tensor by tensor (export then loads it whole)."""


def open_reader(tag_dir: Path, layout: dict, alias: dict):
    """The reader for this checkpoint's layout: pipeline, pp = 1 ZeRO 1-2 or 3, or pp = 1 module."""
    if layout.get("tp", 1) > 1:
        raise NotStreamable("tensor-parallel shards are merged whole (state.merge_tp_shards)")
    if layout.get("pp", 1) > 1:
        return PipelineReader(tag_dir, layout, alias)
    optim = sorted(tag_dir.glob("*_optim_states.pt"), key=_natural)
    if not optim:
        return ModuleReader(tag_dir, layout, alias)
    stage = _load(optim[0])["optimizer_state_dict"].get("zero_stage")
    return (Zero3Reader if stage == 3 else Zero12Reader)(tag_dir, optim, alias)


def _load(path: Path):
    return torch_load(path, mmap=True)


def _natural(path: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


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

    def __init__(self, tag_dir: Path, layout: dict, alias: dict):
        self.tag_dir, self.layout, self.alias = tag_dir, layout, alias
        self.masters = {}  # stage -> [optimizer partition files (BF16_Optimizer's or ZeRO-1's), one per dp rank]
        for path in sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt"), key=_natural):
            if PARTITION_FILE.fullmatch(path.name):
                dp_rank, stage = map(int, PARTITION_FILE.fullmatch(path.name).groups())
                self.masters.setdefault(stage, []).append((dp_rank, path))

    def names(self) -> list:
        return list(dict.fromkeys(self.alias.get(hf, hf) for names in self.layout["hf_names"] for hf in names.values()))

    def groups(self):
        done = set()
        for i, names in enumerate(self.layout["hf_names"]):
            todo = {k: hf for k, hf in names.items() if self.alias.get(hf, hf) not in done}
            if not todo:
                continue  # DeepSpeed saves a tied module once, with its first layer
            layer = _load(self.tag_dir / f"layer_{i:02d}-model_states.pt")
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
        stage = next((s for s in range(len(self.layout.get("parts", [])) - 1)
                      if self.layout["parts"][s] <= index < self.layout["parts"][s + 1]), None)
        if stage is None:
            return {}
        ties = {t for t, layers in self.layout.get("tied", {}).items() if layers and min(layers) == index}

        def mine(name):
            head, _, rest = name.partition(".")
            return head == str(index) or (head == "tied_modules" and rest.partition(".")[0] in ties)

        if stage not in self.masters:  # fp16 at ZeRO-0: the wrapper's masters in the stage's mp_rank file
            path = self.tag_dir / f"mp_rank_{stage:02d}_model_states.pt"
            found = zero0_stage_masters(path, mmap=True) if path.is_file() else {}
            return masters_by_hf_name({key: v for key, v in found.items() if mine(key[1])}, self.layout)
        pieces = {}
        for _, path in sorted(self.masters[stage]):
            saved = _load(path)["optimizer_state_dict"]
            for flat, mapping in zip(saved["single_partition_of_fp32_groups"], saved["param_slice_mappings"]):
                for name, where in mapping.items():
                    if mine(name):
                        pieces.setdefault((stage, name), []).append(flat.narrow(0, where.start, where.numel))
            del saved
        return masters_by_hf_name(pieces, self.layout)


class ModuleReader:
    """pp = 1 without ZeRO files: mp_rank_00_model_states.pt's module (+ ZeRO-0's fp32 masters in it)."""

    def __init__(self, tag_dir: Path, layout: dict, alias: dict):
        self.path, self.layout, self.alias = tag_dir / "mp_rank_00_model_states.pt", layout, alias
        saved = _load(self.path)
        if not isinstance(saved, dict) or "module" not in saved:
            raise UnusableInput(f"{self.path} holds no 'module' state dict: not a DeepSpeed model checkpoint")
        self._names = list(saved["module"]) + list(zero0_masters(saved, layout))

    def names(self) -> list:
        return list(dict.fromkeys(self.alias.get(n, n) for n in self._names))

    def groups(self):
        done = set()
        for names in block_groups(self._names):
            saved = _load(self.path)
            masters = {self.alias.get(n, n): t for n, t in zero0_masters(saved, self.layout).items()}
            group = {}
            for n in names:
                name = self.alias.get(n, n)
                if name not in done and name not in group:
                    group[name] = masters[name] if name in masters else saved["module"][n]
            del saved, masters
            done.update(group)
            yield group


class _ZeroReader:
    """pp = 1 under ZeRO: the model states file(s) name the parameters and hold the buffers; each
    rank's optimizer file holds its partition of the fp32 masters."""

    def __init__(self, tag_dir: Path, optim: list, alias: dict, model_glob: str = "*_model_states.pt"):
        self.optim, self.alias = optim, alias
        model_files = sorted(tag_dir.glob(model_glob), key=_natural)
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
        self.shapes = [dict(group) for group in saved["param_shapes"]]
        self.paddings = opt.get("param_alignment_paddings")
        self.frozen = list(saved.get("frozen_param_shapes") or {})
        self.module = [k for k, v in saved["module"].items() if v.numel()]  # ZeRO-3: empty placeholders
        self.shared = dict(saved.get("shared_params") or {})

    def names(self) -> list:
        trainable = [n for group in self.shapes for n in group]
        every = self.module + trainable + self.frozen + [a for a, b in self.shared.items() if b in trainable]
        return list(dict.fromkeys(self.alias.get(n, n) for n in every))

    def groups(self):
        order = list(dict.fromkeys(self.module + [n for g in self.shapes for n in g] + self.frozen))
        done = set()
        for names in block_groups(order):
            saved = _load(self.model_file)
            flats = [self._flat_groups(_load(path)["optimizer_state_dict"]) for path in self.optim]
            group = {}
            for n in names:
                name = self.alias.get(n, n)
                value = next((m for m in (self._master(c, flats) for c in (n, self.shared.get(n), name) if c)
                              if m is not None), None)
                if value is None and n in self.frozen:
                    value = (saved.get("frozen_param_fragments") or {}).get(n)
                if value is None:
                    value = saved["module"].get(n)
                if name not in done and name not in group and value is not None:
                    group[name] = value
            del saved, flats
            done.update(group)
            yield group


class Zero12Reader(_ZeroReader):
    """ZeRO 1-2: per group, the ranks' partitions laid end to end hold the group's parameters in order."""

    def __init__(self, tag_dir: Path, optim: list, alias: dict):
        super().__init__(tag_dir, optim, alias)
        self.where = {}  # name -> (group, offset in the group's concatenation, numel, shape)
        for g, shapes in enumerate(self.shapes):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                self.where[name] = (g, offset, numel, shape)
                offset += numel + (self.paddings[g][i] if self.paddings else 0)

    @staticmethod
    def _flat_groups(opt: dict) -> list:
        return opt["single_partition_of_fp32_groups"]

    def _master(self, name: str, flats: list):
        if name not in self.where:
            return None
        g, offset, numel, shape = self.where[name]
        size = flats[0][g].numel()  # every rank's partition of group g has this many elements
        parts = []
        for r, rank_groups in enumerate(flats):
            lo, hi = max(offset, r * size), min(offset + numel, (r + 1) * size)
            if lo < hi:
                parts.append(rank_groups[g][lo - r * size: hi - r * size])
        return _joined(parts).view(shape)


class Zero3Reader(_ZeroReader):
    """ZeRO-3: every parameter is cut in `world` equal pieces (the last padded), rank r's piece lying
    at the same offset of r's groups laid end to end."""

    def __init__(self, tag_dir: Path, optim: list, alias: dict, model_glob: str = "*_model_states.pt"):
        super().__init__(tag_dir, optim, alias, model_glob)
        if self.frozen:
            raise NotStreamable("frozen parameters under ZeRO-3")
        self.where, offset = {}, 0
        for name, shape in (item for group in self.shapes for item in group.items()):
            piece = math.ceil(math.prod(shape) / self.world)
            self.where[name] = (offset, piece, shape)
            offset += piece

    @staticmethod
    def _flat_groups(opt: dict) -> list:
        return opt["fp32_flat_groups"]

    def _master(self, name: str, flats: list):
        if name not in self.where:
            return None
        offset, piece, shape = self.where[name]
        parts = [p for rank_groups in flats for p in _span(rank_groups, offset, offset + piece)]
        return _joined(parts)[: math.prod(shape)].view(shape)


def _span(flat_groups: list, lo: int, hi: int) -> list:
    """Elements lo..hi of the flat tensors laid end to end, as views of them."""
    out, start = [], 0
    for flat in flat_groups:
        end = start + flat.numel()
        if lo < end and hi > start:
            out.append(flat[max(lo, start) - start: min(hi, end) - start])
        start = end
    return out


def _joined(parts: list):
    import torch

    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()
