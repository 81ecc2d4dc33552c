"""deepspeed.initialize and DeepSpeed's own load of a checkpoint, around its bf16/fp16 optimizer wrappers.

Which wrapper DeepSpeed picks, and what dstk does about each, is toolkit.distributed.optimizers' (read by the
checkpoints too): `initialize` settles an FP16 wrapper right after it is built, and `load` has DeepSpeed read a
BF16_Optimizer's per-rank files itself at ZeRO-0 (the engine hands it the model states' single dict).
"""

import contextlib

from toolkit.distributed.optimizers import is_bf16_optimizer, settle


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
