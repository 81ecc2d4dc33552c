"""DeepSpeed's optimizer wrappers for bf16/fp16 weights, and what dstk does around them (deepspeed 0.19): which
wrapper an engine holds, and the state dstk gives it. The trainer (toolkit.train.engine: the engine built, a
checkpoint loaded) and the checkpoints (toolkit.checkpoint.portable: a state restored by HF name) both read it.

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
    `state_dict_list[dp_rank]`: KeyError 0). toolkit.train.engine.load has DeepSpeed read those files itself.
  - the FP16 wrappers' base optimizer steps their fp32 masters, not the module's parameters: a state restored by HF
    name (toolkit.checkpoint.portable) goes there through `restore_masters`.
"""

FP16_WRAPPERS = ("FP16_Optimizer", "FP16_UnfusedOptimizer")


def _kind(optimizer) -> str:
    return type(optimizer).__name__


def is_fp16_wrapper(optimizer) -> bool:
    return _kind(optimizer) in FP16_WRAPPERS


def is_bf16_optimizer(optimizer) -> bool:
    return _kind(optimizer) == "BF16_Optimizer"


def settle(engine) -> None:
    """Right after deepspeed.initialize: an FP16 wrapper's optimizer starts from no step, as every other
    layout's does (the masters copied back from the module, which that zero-gradient step left alone)."""
    optimizer = engine.optimizer
    if is_fp16_wrapper(optimizer):
        optimizer.optimizer.state.clear()  # torch's AdamW and FusedAdam make their state again at the first step
        optimizer.refresh_fp32_params()


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
