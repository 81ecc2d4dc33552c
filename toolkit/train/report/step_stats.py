"""What each step measures beyond its loss, on every rank, gathered for rank 0's log in one collective per
step (StepStats): the global gradient norm at every precision and ZeRO stage, the peak memory over the
ranks and, at pp > 1, each stage's forward and backward seconds (StageClock)."""

import time


class StageClock:
    """Seconds this rank spends in its pipeline stage's forward and backward passes. DeepSpeed's own timers
    (wall_clock_breakdown) assert under pipelines, so dstk times the PipelineEngine's ForwardPass and
    BackwardPass instructions, in the engine's own instruction table. On CUDA a pass is timed with events
    (no host sync inside the schedule); take() waits once, after the step, for the last one."""

    def __init__(self, engine):
        from deepspeed.runtime.pipe import schedule

        self.cuda = engine.device.type == "cuda"
        self.spans = {"forward": [], "backward": []}
        table = dict(engine._INSTRUCTION_MAP)  # the class's table, copied: other engines keep theirs
        for kind, name in ((schedule.ForwardPass, "forward"), (schedule.BackwardPass, "backward")):
            table[kind] = self._timed(table[kind], self.spans[name])
        engine._INSTRUCTION_MAP = table  # _exec_schedule looks instructions up through self

    def _timed(self, instruction, spans: list):
        def timed(engine, **kwargs):
            start = self._now()
            instruction(engine, **kwargs)
            spans.append((start, self._now()))

        return timed

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> tuple[float, float]:
        """(forward s, backward s) since the last take."""
        out = []
        for spans in self.spans.values():
            if self.cuda:
                if spans:
                    spans[-1][1].synchronize()
                out.append(sum(start.elapsed_time(end) for start, end in spans) / 1000)
            else:
                out.append(sum(end - start for start, end in spans))
            spans.clear()
        return out[0], out[1]


def track_grad_norm(engine) -> None:
    """Make engine.get_global_grad_norm() answer at every precision and ZeRO stage. DeepSpeed's ZeRO and
    bf16/fp16 optimizers compute the norm in their step; a plain fp32 run (ZeRO 0) does not, so dstk
    computes it as DeepSpeed's clipping does (each gradient counted once over the pipeline x tensor-parallel
    group: models.pipeline.mark_grad_norm_owners) and hands it to the optimizer, where the engine reads it
    after the step. With gradient clipping the norm is the one before clipping."""
    optimizer = engine.optimizer
    if optimizer is None or hasattr(optimizer, "_global_grad_norm") or not hasattr(optimizer, "register_step_pre_hook"):
        return  # DeepSpeed's wrappers keep their own; an optimizer dstk cannot hook logs none
    if engine.gradient_clipping() > 0:
        from deepspeed.runtime.utils import clip_grad_norm_

        def clip_and_keep_the_norm():  # replaces the engine's clip_fp32_gradients, which drops the norm
            optimizer._global_grad_norm = clip_grad_norm_(engine.module.parameters(), engine.gradient_clipping(),
                                                          mpu=engine.mpu)

        engine.clip_fp32_gradients = clip_and_keep_the_norm
    else:
        def keep_the_norm(*_):
            optimizer._global_grad_norm = grad_norm(engine)

        optimizer.register_step_pre_hook(keep_the_norm)


def grad_norm(engine) -> float:
    """The 2-norm of every gradient of the model, on this rank's share: each parameter counted once over the
    model-parallel (pipeline x tp) group, by DeepSpeed's rule (a rank other than the group's first counts
    only its `model_parallel` parameters); the gradients are the same on every dp replica once reduced."""
    import torch

    from toolkit.distributed.process_group import all_reduce_sum

    mpu = engine.mpu
    first = mpu is None or mpu.get_model_parallel_rank() == 0
    squares = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters()
               if p.grad is not None and (first or getattr(p, "model_parallel", False))]
    mine = torch.stack(squares).sum() if squares else torch.zeros((), device=engine.device)
    group = mpu.get_model_parallel_group() if mpu is not None else None
    return all_reduce_sum(mine, engine.device, group=group)[0] ** 0.5 if group is not None else float(mine) ** 0.5


class StepStats:
    """Every rank's measures of a step, one collective (toolkit.distributed.process_group.all_gather_rows):
    call start() before the step and gather() after it, on every rank. gather() returns the log's fields
    (the same on every rank): grad_norm, peak_mem_mib (the most any rank has held since training began:
    GPU memory allocated on CUDA, else the host's resident set; report.memory) and at pp > 1
    stage_forward_s and stage_backward_s, per stage, the mean over the stage's ranks."""

    def __init__(self, engine, pipeline: bool):
        self.engine = engine
        self.clock = StageClock(engine) if pipeline else None
        track_grad_norm(engine)

    def start(self) -> None:
        if self.clock is not None:
            self.clock.take()  # whatever ran between steps (an evaluation) is not the step's

    def gather(self) -> dict:
        from toolkit.distributed.process_group import all_gather_rows
        from toolkit.train.report.memory import peak_memory_mib

        engine = self.engine
        forward, backward = self.clock.take() if self.clock is not None else (0.0, 0.0)
        stage = engine.stage_id if self.clock is not None else 0
        rows = all_gather_rows([stage, forward, backward, peak_memory_mib(engine.device)], engine.device)
        norm = engine.get_global_grad_norm()
        out = {"grad_norm": None if norm is None else float(norm), "peak_mem_mib": round(max(r[3] for r in rows), 1)}
        if self.clock is not None:
            stages = sorted({int(r[0]) for r in rows})
            for i, key in ((1, "stage_forward_s"), (2, "stage_backward_s")):
                per_stage = [[r[i] for r in rows if int(r[0]) == s] for s in stages]
                out[key] = [round(sum(v) / len(v), 6) for v in per_stage]
        return out
