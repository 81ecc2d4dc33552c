"""What a DeepSpeed engine holds for the model on this rank: parameters, gradients, fp32 masters and
optimizer states, in bytes, each storage counted once (views into DeepSpeed's flat buffers share one).

This is the quantity toolkit.plan.memory.rank predicts (model-state bytes per rank); the run summary
reports it at the end of training, and tests/distributed/test_memory_accuracy.py measures it inside
a step, where it peaks.
"""


def held_bytes(engine) -> int:
    """Bytes of distinct storages among parameters (ZeRO-3: the rank's partition), gradients, master
    weights and optimizer state, and the flat buffers a ZeRO / bf16 optimizer wrapper keeps."""
    seen, total = set(), 0
    candidates = []
    for p in engine.module.parameters():
        candidates += [getattr(p, "ds_tensor", None), p.data, p.grad]
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    if inner is not None:
        for group in inner.param_groups:
            candidates += [x for p in group["params"] for x in (p, p.grad)]
        candidates += [v for state in inner.state.values() for v in state.values()]
    if opt is not inner:  # a ZeRO / bf16 wrapper: its flat partitions, gradient buffers and buckets
        candidates += [t for value in vars(opt).values() for t in tensors_in(value)]
    for t in candidates:
        if t is None or not hasattr(t, "untyped_storage") or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def tensors_in(obj, depth: int = 0):
    """The tensors in `obj`, up to 3 levels into lists, dicts and (below the top) plain objects."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth >= 3 or isinstance(obj, (str, bytes, type, torch.nn.Module)):
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x, depth + 1)
    elif hasattr(obj, "__dict__") and depth > 0:  # bucket objects inside the optimizer's dicts
        for x in vars(obj).values():
            yield from tensors_in(x, depth + 1)
