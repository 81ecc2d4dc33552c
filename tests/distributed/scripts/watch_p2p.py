"""`python watch_p2p.py OUT ARGS`: `python -m toolkit.train ARGS` with the point-to-point operations and
collectives that DeepSpeed's pipeline engine issues recorded, in issue order, in OUT/rank<R>.json at exit: the
units of tests/p2p_order.py (a blocking send or recv, one batch_isend_irecv with its ops, a collective with its
group's ranks and name), each with "at": where it was issued ("init": PipelineEngine.__init__, "train N",
"eval N": the N-th train_batch / eval_batch). Nothing is faked: every call goes on to the real one."""

import json
import os
import runpy
import sys
from functools import wraps
from pathlib import Path

import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.distributed import distributed_c10d as c10d

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
units, state = [], {"at": None, "inside": 0, "count": {}}


def _what(tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _group(group) -> dict:
    """A unit's process group: "comm" its name ("world" for the default group), "group" its global ranks."""
    world = c10d._get_default_group()
    group = group or world
    return {"comm": "world" if group is world else group.group_name, "group": dist.get_process_group_ranks(group)}


def _recorded(describe, real):
    """`real`, recording describe(args, kwargs) as a unit first; the calls it makes itself are not units of their
    own (torch's send is isend and a wait; gloo runs a batch as isend/irecv calls)."""
    @wraps(real)
    def call(*args, **kwargs):
        if state["at"] is not None and not state["inside"]:
            units.append({**describe(args, kwargs), "at": state["at"]})
        state["inside"] += 1
        try:
            return real(*args, **kwargs)
        finally:
            state["inside"] -= 1
    return call


def _p2p(direction):
    def describe(args, kwargs):
        tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
        return {"kind": direction, **_group(kwargs.get("group")), "ops": [[direction, peer, _what(tensor)]]}
    return describe


def _batch(args, kwargs):
    ops = args[0] if args else kwargs["p2p_op_list"]
    ends = [["send" if o.op.__name__ == "isend" else "recv", o.peer, _what(o.tensor)] for o in ops]
    return {"kind": "batch", **_group(ops[0].group), "ops": ends}


def _collective(name):
    return lambda args, kwargs: {"kind": "coll", "name": name, **_group(kwargs.get("group"))}


def _during(label, real):
    @wraps(real)
    def method(self, *args, **kwargs):
        count = state["count"][label] = state["count"].get(label, 0) + 1
        before, state["at"] = state["at"], label if label == "init" else f"{label} {count}"
        try:
            return real(self, *args, **kwargs)
        finally:
            state["at"] = before
    return method


watched = {name: _recorded(_p2p(name.removeprefix("i")), getattr(c10d, name))
           for name in ("send", "recv", "isend", "irecv")}
watched["batch_isend_irecv"] = _recorded(_batch, c10d.batch_isend_irecv)
watched.update({name: _recorded(_collective(name), getattr(c10d, name)) for name in COLLECTIVES})
for module in (dist, c10d):  # one wrapper object per name: batch_isend_irecv tells isend from irecv by identity
    for name, fn in watched.items():
        setattr(module, name, fn)
for label, name in (("init", "__init__"), ("train", "train_batch"), ("eval", "eval_batch")):
    setattr(PipelineEngine, name, _during(label, getattr(PipelineEngine, name)))

out = Path(sys.argv[1])
sys.argv = ["toolkit.train", *sys.argv[2:]]
try:
    runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
finally:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(units))
