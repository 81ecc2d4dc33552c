"""`python watch_collectives.py OUT ARGS`: `python -m toolkit.train ARGS` with torch.distributed's tensor
collectives watched. Each call is recorded in OUT/rank<R>.json at exit: the collective, the device of
each tensor it got, the engine's device (DeepSpeed's accelerator: cuda:N on a GPU, cpu here), whether an
object collective (all_gather_object, ...) made it, and the first caller outside torch and deepspeed.comm:
"toolkit/distributed/process_group.py"
for dstk's own helper, "deepspeed/..." for the engine's calls. Nothing is faked: every call goes on to
the real collective."""

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

REPO = Path(__file__).resolve().parents[3]
TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                      "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
                      "isend", "irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
calls = []


def _caller() -> tuple:
    """(first caller outside torch, relative to the repository or site-packages; via an object collective?)"""
    frames = traceback.extract_stack()[:-2]  # without this function and the wrapper
    via_object = any(f.name in OBJECT_COLLECTIVES for f in frames)
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "/deepspeed/comm/" not in frame.filename:
            path = frame.filename
            where = path.split("site-packages/")[-1] if "site-packages/" in path else os.path.relpath(path, REPO)
            return f"{where}:{frame.lineno}", via_object
    return "?", via_object


def _tensors(args, kwargs) -> list:
    found = []
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


def _watched(name, real):
    def collective(*args, **kwargs):
        from deepspeed.accelerator import get_accelerator

        caller, via_object = _caller()
        calls.append({"fn": name, "devices": sorted({str(t.device) for t in _tensors(args, kwargs)}),
                      "engine": str(torch.device(get_accelerator().current_device_name())), "caller": caller,
                      "object": via_object})
        return real(*args, **kwargs)
    return collective


for module in (dist, c10d):
    for name in TENSOR_COLLECTIVES:
        if hasattr(module, name):
            setattr(module, name, _watched(name, getattr(c10d, name)))

out = Path(sys.argv[1])
sys.argv = ["toolkit.train", *sys.argv[2:]]
try:
    runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
finally:
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(calls))
