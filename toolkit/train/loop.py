"""The step loop toolkit.train runs once its Job is built (toolkit.train.job): steps, evaluation, checkpoints.

`train_step` is one optimizer step of gbs rows: train_batch() for a pipeline, gas forward/backward/step calls for
pp = 1. `eval_loss` runs the eval split through the same staging and forward (`stage_batch`, `forward_loss`).
"""

import time

import torch
import torch.distributed as dist

from models.tiled.offload import around_micro_batch
from toolkit.distributed.process_group import all_reduce_sum
from toolkit import data
from toolkit.data.transfer import to_device
from toolkit.checkpoint import manifest
from toolkit.checkpoint.run_folder import RunFolder
from toolkit.train.job import Job
from toolkit.train.preference import stage_metrics
from toolkit.train.report import ProgressLog, memory, per_rank
from toolkit.train.report.summary import throughput
from toolkit.train.report.step_stats import StepStats


def train_step(job: Job, it) -> float:
    """One optimizer step; returns the loss averaged over micro-batches and dp replicas."""
    if job.pipeline:
        return float(job.engine.train_batch(it))
    losses = []
    for _ in range(job.engine.gradient_accumulation_steps()):
        with around_micro_batch(job.engine.module):  # --offload-activations: the checkpoints' trip to the host
            loss = forward_loss(job.engine, next(it), job.sp, job.sp_rank, job.objective)
            job.engine.backward(loss * job.backward_scale if job.backward_scale != 1 else loss)
        job.engine.step()
        losses.append(loss.detach().float())
    # pp = 1: every sp group is a replica, whose ranks' losses sum to its loss (sp = 1: every rank)
    return all_reduce_sum(torch.stack(losses).mean(), job.engine.device)[0] / (dist.get_world_size() // job.sp)


def stage_batch(job: Job, batch):
    """A micro-batch as the engine takes it. pp = 1: as read (forward_loss builds the model's inputs on the host,
    then moves them). A pipeline's: under sp this rank's slice of the sequence (toolkit.distributed.
    sequence_parallel.stage_batch), copied to the device here (to_device: non-blocking, from pinned memory on CUDA)
    on the current stream, the one DeepSpeed's PipelineEngine runs on: its _exec_load_micro_batch, which calls
    next() on this iterator, then clones the tensors on the device and its blocking .to(device) copies nothing.
    Only first and last stages pull micro-batches; each copies both halves (a few KiB it may not read)."""
    if not job.pipeline:
        return batch
    if job.sp > 1:
        from toolkit.distributed.sequence_parallel import stage_batch as sliced

        batch = sliced(batch, job.sp, job.sp_rank)
    return to_device(batch, job.engine.device)


def forward_loss(engine, batch, sp: int = 1, sp_rank: int = 0, objective=None) -> torch.Tensor:
    """pp = 1: the HF model on a batch whose second tensor holds document ids (packed rows: positions
    restart and attention stays inside each document, models.attention.model_inputs, built on the host:
    no device sync). DeepSpeedEngine.forward does not move inputs (only the PipelineEngine does).
    sp > 1: this rank's slice of the sequence; its loss is its share of the micro-batch's mean, the sp
    group's shares summing to it (toolkit.distributed.sequence_parallel). Every tensor reaches the device through
    to_device: non-blocking, from pinned memory on CUDA, on the stream the forward then runs on. objective:
    --objective dpo's (toolkit.train.preference.forward_loss)."""
    from models.attention import model_inputs

    if objective is not None:
        from toolkit.train.preference import forward_loss as preference_loss

        return preference_loss(engine, batch, objective)

    if sp > 1:
        from toolkit.distributed.sequence_parallel import shard

        return engine(**to_device(shard(batch, sp, sp_rank), engine.device)).loss
    (input_ids, doc_ids), labels = batch
    if labels.dim() == 1:  # a classifier (BERT): never packed, a padding mask
        inputs = {"attention_mask": doc_ids}
    else:
        inputs = model_inputs(doc_ids, engine.module.config)
    return engine(**to_device({"input_ids": input_ids, "labels": labels, **inputs}, engine.device)).loss


def eval_loss(job: Job) -> float | None:
    """The mean loss over every target of the whole eval split, each token (a classifier: each row)
    weighted alike: sum(mean loss of a micro-batch * its targets) / targets, over all dp ranks. None
    without an eval split (--eval-fraction 0)."""
    if len(job.eval_set) == 0:
        return None
    count = data.eval_batch_count(len(job.eval_set), job.train.mbs, job.dp)
    # DualPipeV: eval_batch calls of exactly gas micro-batches, the last filled up with filler (no loss).
    # DeepSpeed 0.19.8's DualPipeVEngine finds a micro-batch's phase-1 buffer at buffer + gas
    # (dualpipev.py:186-188, _phase1_buffer) while its eval schedule numbers them buffer + num_micro_batches:
    # any other count leaves the turn-around's inputs where the phase-1 forward does not look (None.clone()).
    chunk = job.engine.micro_batches if (job.record or {}).get("schedule") == "dualpipev" else count
    count = -(-count // chunk) * chunk
    weights = []  # targets per micro-batch, in the order the engine pulls them
    progress = eval_progress(job, count) if dist.get_rank() == 0 else None

    def batches():
        for batch in data.eval_micro_batches(job.eval_set, job.train.mbs, job.dp, job.dp_rank, count):
            weights.append(data.loss_weight(batch[1]))
            if progress is not None:
                progress.update(job.train.mbs * job.dp, batch[0][0].numel() * job.dp)
            yield stage_batch(job, batch)

    if job.pipeline:
        stream, losses = batches(), []
        for _ in range(count // chunk):
            chunk_losses = job.engine.eval_batch(stream, reduce_output=None, bcast_loss=False, num_micro_batches=chunk)
            losses += [float(x) for x in chunk_losses] if job.engine.is_last_stage() else []  # the loss stage's only
    else:
        job.engine.eval()
        with torch.no_grad():
            losses = [float(forward_loss(job.engine, b, job.sp, job.sp_rank, job.objective)) for b in batches()]
        job.engine.train()
    if progress is not None and progress.last != progress.start:  # it said something: say it ended
        progress.close()
    total = sum(loss * w for loss, w in zip(losses, weights) if w)  # an all-filler micro-batch's mean is nan
    # every replica's share (pipelines: the last stages' only). sp > 1 at pp = 1: a rank's loss is its share of
    # the micro-batch's mean, and the group's ranks count its targets once; in a pipeline each rank's loss is
    # sp x its share (sequence_parallel.PipelineLoss), so each counts them
    share = job.sp if not job.pipeline else 1
    total, count = all_reduce_sum([total, float(sum(weights) / share if losses else 0)], job.engine.device)
    return total / count if count else None


def eval_progress(job: Job, count: int):
    """Rank 0's progress line over an evaluation of `count` micro-batches per replica (every ~30 s in a log, as
    tokenizing does; nothing for one that ends sooner), unless --no-progress. Rows: the eval split's, filler too."""
    from toolkit.data.tokens import Progress

    if not job.progress:
        return None
    return Progress(f"eval: {len(job.eval_set):,} rows", count * job.train.mbs * job.dp)


def run_steps(args, job: Job, is_logger: bool, watchdog=None, signals=None) -> dict:
    """Steps start_step+1 .. steps: log, evaluate, checkpoint; returns the run's summary. Its tokens/s (and
    MFU) leave out the run's first step (report.summary.throughput); its peak memory counts from just before
    that step, the load's peak beside it (report.memory.reset_peaks). Each step, eval and save is a section of
    `watchdog` (--step-timeout); with `signals` (--save-on-signal) the ranks stop after the step in which any of
    them received one, with a checkpoint of it (summary["stopped_by"])."""
    from toolkit.distributed.resilience import crash_injected, fault_in_step, section
    from toolkit.train.report.trackers import check_report_to

    # pinned where the engine's device is a CUDA one (on the stream's prefetch thread when --streaming)
    it = (stage_batch(job, batch) for batch in job.train.micro_batches(job.start_step, pin_for=job.engine.device))
    stats = StepStats(job.engine, job.pipeline)  # on every rank: each step's measures are gathered
    log = ProgressLog(RunFolder(args.out), job, args, check_report_to(args.report_to)) if is_logger else None
    load_peaks = memory.reset_peaks(job.engine.device)  # built, not yet stepped: training's peaks count from here
    losses, step_seconds, start, stopped_by = [], [], time.perf_counter(), None
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    for step in range(job.start_step + 1, job.steps + 1):
        stats.start()
        t0 = time.perf_counter()
        with section(watchdog, f"step {step}"):
            fault_in_step(args.crash_in_step, args.stall_at_step, step, last_rank)
            loss = train_step(job, it)
            stopped_by = signals.agreed(job.engine.device) if signals is not None else None
        seconds = time.perf_counter() - t0
        step_seconds.append(seconds)
        record = {"step": step, "loss": loss, "lr": job.engine.get_lr()[0], **stats.gather(),
                  "tokens_per_s": job.tokens_per_step / seconds, "samples_per_s": job.rows_per_step / seconds,
                  **stage_metrics(job.objective, job.engine.device)}  # DPO: TRL's rewards/..., logps/...
        if args.eval_every and step % args.eval_every == 0 and step != job.steps and len(job.eval_set) and not stopped_by:
            with section(watchdog, f"evaluating after step {step}"):
                record["eval_loss"] = eval_loss(job)
                record.update(stage_metrics(job.objective, job.engine.device, "eval_"))
            record["eval_ppl"] = _perplexity(record["eval_loss"]) if job.objective is None else None
        if step == job.steps or (args.save_every and step % args.save_every == 0) or stopped_by:
            with section(watchdog, f"saving global_step{step}"):
                manifest.save(job.engine, job.ckpt_dir, step, frozen=job.save_frozen, param_names=job.param_names,
                              manifest=job.record, data_position=getattr(job.train, "position", None))
        losses.append(loss)
        if log:
            log.write(record)
        crash_injected(args.crash_at_step, step, last_rank)
        if stopped_by:
            break
    with section(watchdog, "the final evaluation"):
        final_eval = eval_loss(job) if not stopped_by else None
        final_metrics = stage_metrics(job.objective, job.engine.device, "eval_")
    summary = {"steps": job.steps, "start_step": job.start_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "eval_loss": final_eval, **final_metrics,
               "eval_ppl": _perplexity(final_eval) if job.objective is None else None, "data": _data_summary(job),
               **throughput(step_seconds, job.tokens_per_step, job.rows_per_step),
               "seconds": time.perf_counter() - start, "run": job.about, **per_rank(job.engine, load_peaks)}
    if stopped_by:
        summary.update(stopped_by=stopped_by, stopped_at=job.start_step + len(losses))
    if log:
        log.close(summary)
    return summary


def _data_summary(job: Job) -> dict | None:
    """The summary's "data": the preparation's counts, or a stream's description and where this rank got to."""
    position = getattr(job.train, "position", None)
    return job.data_info if position is None or job.data_info is None else {**job.data_info, "position": position}


def _perplexity(loss: float | None) -> float | None:
    import math

    return None if loss is None else math.exp(min(loss, 700.0))  # exp(710) overflows a float
