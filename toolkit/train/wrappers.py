"""DeepSpeed's optimizer wrappers for bf16/fp16 weights, and what dstk does around them (deepspeed 0.19).

DeepSpeed picks the wrapper from the weights' dtype, the gradient-accumulation dtype
(`data_types.grad_accum_dtype`, default: the weights') and the ZeRO stage (runtime/engine.py
`_do_optimizer_sanity_check`):
  ZeRO-0, bf16, pp = 1 / fp16      FP16_UnfusedOptimizer (torch's AdamW: an fp32 master per parameter),
                                   FP16_Optimizer (FusedAdam: one flat fp32 master per parameter group)
  ZeRO-0, bf16, pipeline           BF16_Optimizer, accumulating in bf16
  ZeRO-1, bf16, fp32 accumulation  BF16_Optimizer, its masters partitioned over dp (no offload)
  any other ZeRO 1-3               DeepSpeed's ZeRO optimizers
  ZeRO-0, accumulation dtype other than the weights'   NotImplementedError (toolkit.config.rules.accumulation refuses it)
Three of these need dstk's help:
  - the FP16 wrappers take one optimizer step on zero gradients when they are built
    (runtime/fp16/unfused_optimizer.py:412-425, fused_optimizer.py:125-130): Adam then counts one step too many
    (its first real update is 0.74 lr instead of lr) and AdamW decays the masters once. `settle` forgets that step.
  - BF16_Optimizer at ZeRO-0 saves its state per dp rank (bf16_zero_pp_rank_*), as under ZeRO, but the engine
    hands it the model states' single dict when it loads (engine.py:4696 -> bf16_optimizer.py:670,
    `state_dict_list[dp_rank]`: KeyError 0). `load` has DeepSpeed read those files itself.
  - the FP16 wrappers' base optimizer steps their fp32 masters, not the module's parameters: a state restored by HF
    name (toolkit.checkpoint.portable) goes there through `restore_masters`.
"""

import contextlib

FP16_WRAPPERS = ("FP16_Optimizer", "FP16_UnfusedOptimizer")


def _kind(optimizer) -> str:
    return type(optimizer).__name__


def is_fp16_wrapper(optimizer) -> bool:
    return _kind(optimizer) in FP16_WRAPPERS


def is_bf16_optimizer(optimizer) -> bool:
    return _kind(optimizer) == "BF16_Optimizer"


def initialize(model, groups: list, config: dict, verbose: bool = False, mpu=None):
    """deepspeed.initialize on the GPU toolkit.distributed.process_group chose, settled; its prints (BF16_Optimizer reports memory
    on stdout, forced, while it builds) only with --verbose. mpu: Ulysses' groups (sp > 1), else None."""
    import contextlib
    import io

    import deepspeed

    from toolkit.distributed.process_group import engine_args

    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        engine, *_ = deepspeed.initialize(args=engine_args(), model=model, model_parameters=groups, config=config,
                                           mpu=mpu)
    settle(engine)
    return engine


def settle(engine) -> None:
    """Right after deepspeed.initialize: an FP16 wrapper's optimizer starts from no step, as every other
    layout's does (the masters copied back from the module, which that zero-gradient step left alone)."""
    optimizer = engine.optimizer
    if is_fp16_wrapper(optimizer):
        optimizer.optimizer.state.clear()  # torch's AdamW and FusedAdam make their state again at the first step
        optimizer.refresh_fp32_params()


def load(engine, ckpt_dir, tag: str, strict: bool):
    """DeepSpeed's own load of a checkpoint written on this layout; the loaded path, or None where
    DeepSpeed found nothing to load."""
    import io

    import torch

    bf16_zero0 = is_bf16_optimizer(engine.optimizer) and not engine.zero_optimization()
    # stdout: BF16_Optimizer prints a line as it loads.
    # no_grad: a pipeline's load_state_dir ends by broadcasting its tied weights in place (module.py
    # _synchronize_tied_weights), which with autograd on records c10d::broadcast_ in the weights' history:
    # torch warns at the next backward ("may lead to silently incorrect behavior"). Nothing in a load needs a
    # graph; the building of the pipeline avoids the same broadcast's warning the same way
    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad(), loads_as_data(engine):
        loaded, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=strict,
                                           load_optimizer_states=not bf16_zero0)
        if loaded is not None and bf16_zero0:  # what load_checkpoint does at ZeRO 1-3: every dp rank's files, a list
            if not engine._load_zero_checkpoint(str(ckpt_dir), tag, load_optimizer_states=True):
                return None
    return loaded


@contextlib.contextmanager
def loads_as_data(engine):
    """DeepSpeed's checkpoint engine (TorchCheckpointEngine: torch.load(weights_only=False)) reads every file of
    the tag it loads (model states, ZeRO partitions, pipeline layers) through toolkit.checkpoint.safe_load."""
    from toolkit.checkpoint import safe_load

    ce = engine.checkpoint_engine
    own = vars(ce).get("load")
    ce.load = lambda path, map_location=None: safe_load.load(path, map_location=map_location)
    try:
        yield
    finally:
        if own is None:
            del ce.load  # the class's method again
        else:
            ce.load = own


def restore_masters(optimizer, states: dict, step) -> None:
    """An FP16 wrapper's fp32 masters and its base optimizer's Adam state from a state restored by HF name:
    `states` {id(module parameter): (fp32 weight, {moment: tensor})}, `step` Adam's step count as the base
    optimizer keeps it. FP16_UnfusedOptimizer keys the state by each parameter's master, FP16_Optimizer by
    its group's flat master (the parameters end to end, in group order)."""
    import torch

    base = optimizer.optimizer
    count = step.clone if hasattr(step, "clone") else lambda: step  # torch's optimizers add to each state's tensor
    if _kind(optimizer) == "FP16_UnfusedOptimizer":
        for lps, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for lp, master in zip(lps, masters):
                weight, moments = states[id(lp)]
                master.data.copy_(weight.reshape(master.shape))
                base.state[master] = {"step": count(), **{k: v.reshape(master.shape).to(master.device).clone()
                                                       for k, v in moments.items()}}
        return
    for lps, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
        flat_moments, offset = {}, 0
        for lp in lps:
            weight, moments = states[id(lp)]
            flat.data.narrow(0, offset, lp.numel()).copy_(weight.reshape(-1))
            for key, value in moments.items():
                flat_moments.setdefault(key, torch.zeros_like(flat)).narrow(0, offset, lp.numel()).copy_(value.reshape(-1))
            offset += lp.numel()
        base.state[flat] = {"step": count(), **flat_moments}
