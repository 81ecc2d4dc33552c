"""--schedule dualpipev: what DeepSpeed's DualPipeV needs of a run, refused before any rank starts.

DeepSpeed 0.19.8 (runtime/pipe/dualpipev.py, schedule.DualPipeVSchedule): pipeline rank r holds stage r
(phase 0, activations flowing out) and stage 2p-1-r (phase 1, flowing back), so rank 0 loads the data and
computes the loss. DualPipeVEngine.__init__ asserts, on every rank once the engine is built:
- gradient_accumulation_steps >= 2 p (the schedule's warm-up fills both phases);
- no pipe_partitioned / grad_partitioned (only in force with a model-parallel axis, i.e. tp > 1);
- no dynamic_shape, no bool tensors between stages (dstk sends hidden states and int64 document ids).
dstk cuts the model into 2 p stages with its cost partitioner (toolkit.distributed.pipeline) and does
not shard DualPipeV stages over a tp group nor run Ulysses inside them: both refused here.
Nothing here imports torch.
"""

from toolkit.errors import ConfigError
from toolkit.plan.dualpipev import min_micro_batches

SCHEDULES = ("1f1b", "dualpipev")


def check(schedule: str, cfg: dict, pp: int, world_size: int | None) -> None:
    """Raise ConfigError naming the flag, the numbers and the fix when `schedule` cannot run this config
    (pp stages, world_size processes when known)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if schedule != "dualpipev":
        return
    from toolkit.distributed.topology import sp_of, tp_of

    if pp < 2:
        raise ConfigError(f"--schedule dualpipev needs pipeline stages: pp is {pp}; pass --pp 2 or more "
                          '(or "pipeline": {"stages": N} in the config), or use --schedule 1f1b')
    tp, sp = tp_of(cfg), sp_of(cfg)
    if tp > 1:
        raise ConfigError(f'--schedule dualpipev with "tensor_parallel": {{"autotp_size": {tp}}}: DeepSpeed\'s '
                          "DualPipeVEngine refuses partitioned pipe activations (pipeline.pipe_partitioned, on with a "
                          "tp axis) and dstk does not shard its two stages per rank; use tp 1 or --schedule 1f1b")
    if sp > 1:
        raise ConfigError(f'--schedule dualpipev with "sequence_parallel_size": {sp}: sequence parallelism is not '
                          "run inside DualPipeV stages; use sequence_parallel_size 1 or --schedule 1f1b")
    if (cfg.get("pipeline") or {}).get("dynamic_shape"):
        raise ConfigError("--schedule dualpipev with pipeline.dynamic_shape: DualPipeV sends activation shapes once "
                          "(DeepSpeed refuses dynamic_shape); drop it (dstk pads rows to --seq-len)")
    gas = _micro_batches(cfg, pp, world_size)
    need = min_micro_batches(pp)
    if gas is not None and gas < need:
        raise ConfigError(f"--schedule dualpipev at pp {pp} needs at least 2 x pp = {need} micro-batches per step, "
                          f"but gradient_accumulation_steps is {gas}; set \"gradient_accumulation_steps\": {need} "
                          f"(or more) in the config, or use --schedule 1f1b")


def _micro_batches(cfg: dict, pp: int, world_size: int | None) -> int | None:
    """gradient_accumulation_steps as the run will have it: written, or derived for world_size processes
    (dp = world_size / pp); None when neither says."""
    gas = cfg.get("gradient_accumulation_steps")
    if isinstance(gas, int) and not isinstance(gas, bool):
        return gas
    if world_size is None or world_size % pp:
        return None
    from toolkit.distributed.topology import config_batch

    try:
        return config_batch(cfg, world_size // pp).gas
    except ConfigError:  # the config's own checks say what is wrong with its batch
        return None



def check_layers(schedule: str, pp: int, model: str, layers: int) -> None:
    """DualPipeV cuts `layers` pipeline layers (embedding, blocks, norm, head) into 2 pp stages of one or more."""
    if schedule == "dualpipev" and pp > 1 and 2 * pp > layers:
        raise ConfigError(f"--schedule dualpipev at pp {pp} cuts --model {model} into 2 x pp = {2 * pp} stages, but it "
                          f"has {layers} pipeline layers (embedding, blocks, norm, head); use --pp {layers // 2} or "
                          "fewer, or --schedule 1f1b")
