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


def parameter_counts(engine, topo, record: dict) -> tuple[int, int]:
    """(parameters, trainable) of the model the run trains, each HF tensor counted once: by its HF name
    (a pipeline stage's names through the manifest `record`: a tied copy, or an unused copy of a tied
    layer's other tensors, names a tensor another stage holds), on data-parallel rank 0 (an AutoEP expert
    parameter on each of dp ranks 0..ep-1, which hold different experts), a tp shard at
    tp x its size, a ZeRO-3 partition at its full size (ds_numel). A collective: every rank calls it."""
    import torch.distributed as dist

    from toolkit.checkpoint.manifest import hf_name_of

    _, dp_rank = topo.coords(dist.get_rank())
    ep = record.get("expert_parallel", 1)  # AutoEP: dp ranks 0..ep-1 each hold experts / ep of every MoE block
    mine = {}
    if dp_rank < ep:
        for name, p in engine.module.named_parameters():
            if hasattr(p, "allreduce") and not p.allreduce:  # DeepSpeed's mark of an expert parameter (is_moe_param)
                name = f"{name}@ep{dp_rank}"
            elif dp_rank:
                continue
            hf = hf_name_of(name, record) if topo.pp > 1 else name
            n = (getattr(p, "ds_numel", None) or p.numel()) * (topo.tp if getattr(p, "tensor_model_parallel", False)
                                                                else 1)
            mine[hf or f"{dist.get_rank()}:{name}"] = (n, p.requires_grad)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    union = {name: entry for rank_names in every for name, entry in rank_names.items()}
    return sum(n for n, _ in union.values()), sum(n for n, trains in union.values() if trains)
