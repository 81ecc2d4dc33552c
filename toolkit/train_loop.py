"""What toolkit.train runs once the process group is up: data, engine, the step loop.

A `Job` holds the engine and this rank's data streams. `train_step` is one optimizer step of
gbs rows: train_batch() for a pipeline, gas forward/backward/step calls for pp = 1.
"""

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import checkpoint, data, train_models


@dataclass
class Job:
    engine: object
    pipeline: bool
    train: data.ShardedBatches
    eval_set: data.TokenData
    start_step: int
    steps: int
    tokens_per_step: int  # gbs * seq_len
    dp: int
    dp_rank: int
    ckpt_dir: Path


def prepare(args, cfg: dict, topo, dp_rank: int) -> Job:
    """Tokenizer, data, model and engine; resumes from the latest checkpoint when asked."""
    import deepspeed

    tokenizer = train_models.load_tokenizer(args.model, args.tokenizer)
    rows = data.read_records(args.data)
    probe = train_models.load_config(args.model, tokenizer, "causal-lm")
    tokens = data.tokenize(rows, tokenizer, args.seq_len, args.task, train_models.max_positions(probe),
                           args.text_field)
    num_labels = int(tokens.labels.max()) + 1 if args.task == "classification" else 2
    config = train_models.load_config(args.model, tokenizer, args.task, num_labels)
    train_set, eval_set = data.split(tokens, args.eval_fraction, args.seed)
    mbs, gas = _batch_sizes(cfg, topo.dp)
    sampler = data.ShardedBatches(train_set, mbs, gas, topo.dp, dp_rank, args.seed)
    ckpt_dir = Path(args.out) / "checkpoints"
    start = _resume_step(ckpt_dir, config) if args.resume else 0
    model, layout = _model(args, config, topo, cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad], config=cfg)
    if dist.get_rank() == 0 and start == 0:
        checkpoint.save_meta(ckpt_dir, config, tokenizer, dict(layout, task=args.task))
    if start:
        engine.load_checkpoint(str(ckpt_dir), tag=checkpoint.read_latest(ckpt_dir))
    steps = args.steps or sampler.steps_per_epoch
    return Job(engine, topo.pp > 1, sampler, eval_set, start, steps, mbs * gas * topo.dp * args.seq_len,
               topo.dp, dp_rank, ckpt_dir)


def _model(args, config, topo, cfg: dict):
    """(model for deepspeed.initialize, layout). pp > 1 with a local directory: no rank builds the
    whole model; each stage reads its own layers' tensors (toolkit.train_pipe)."""
    if topo.pp == 1:
        return train_models.build_model(args.model, config, args.task, args.seed), {"pp": 1}
    from toolkit.train_pipe import pipeline_module

    if Path(args.model).is_dir():
        torch.manual_seed(args.seed)  # heads the directory lacks: the same init on every dp replica
        source = args.model
    else:  # built-in: tiny, random from the seed, identical on every rank and layout
        source = train_models.build_model(args.model, config, args.task, args.seed)
    return pipeline_module(source, args.task, topo, cfg, seq_len=args.seq_len, config=config)


def _batch_sizes(cfg: dict, dp: int) -> tuple[int, int]:
    """(mbs, gas) from the config, deriving the missing one as DeepSpeed does."""
    gbs, mbs, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    mbs = mbs or gbs // ((gas or 1) * dp)
    gas = gas or (gbs // (mbs * dp) if gbs else 1)
    return mbs, gas


def _resume_step(ckpt_dir: Path, config) -> int:
    """The step of the latest complete checkpoint (0 when there is none); refuses another model's."""
    tag = checkpoint.read_latest(ckpt_dir)
    if tag is None:
        return 0
    checkpoint.check_same_model(ckpt_dir, config)
    return checkpoint.step_of(tag)


def train_step(job: Job, it) -> float:
    """One optimizer step; returns the loss averaged over micro-batches and dp replicas."""
    if job.pipeline:
        return float(job.engine.train_batch(it))
    losses = []
    for _ in range(job.engine.gradient_accumulation_steps()):
        loss = _forward(job.engine, next(it))
        job.engine.backward(loss)
        job.engine.step()
        losses.append(loss.detach().float())
    return _dp_mean(torch.stack(losses).mean())


def _forward(engine, batch) -> torch.Tensor:
    (input_ids, attention_mask), labels = batch
    return engine(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _dp_mean(loss: torch.Tensor) -> float:
    dist.all_reduce(loss)  # pp = 1: every rank is a replica
    return float(loss) / dist.get_world_size()


def eval_loss(job: Job, args) -> float:
    """Mean loss over eval_batches steps' worth of eval rows (wrapping around a small split)."""
    if len(job.eval_set) == 0:
        return float("nan")
    gas = job.engine.gradient_accumulation_steps()
    it = data.eval_micro_batches(job.eval_set, job.train.mbs, job.dp, job.dp_rank, gas * args.eval_batches)
    if job.pipeline:
        return sum(float(job.engine.eval_batch(it)) for _ in range(args.eval_batches)) / args.eval_batches
    job.engine.eval()
    with torch.no_grad():
        loss = torch.stack([_forward(job.engine, b).float() for b in it]).mean()
    job.engine.train()
    return _dp_mean(loss)


def loop(args, job: Job, is_logger: bool) -> dict:
    """Steps start_step+1 .. steps: log, evaluate, checkpoint; returns the run's summary."""
    it = job.train.micro_batches(job.start_step)
    log = _Log(Path(args.out) / "metrics.jsonl", job, args.progress) if is_logger else None
    losses, rates, start = [], [], time.perf_counter()
    for step in range(job.start_step + 1, job.steps + 1):
        t0 = time.perf_counter()
        loss = train_step(job, it)
        rates.append(job.tokens_per_step / (time.perf_counter() - t0))  # tokens/s of this step
        record = {"step": step, "loss": loss, "lr": job.engine.get_lr()[0], "tokens_per_s": rates[-1]}
        if args.eval_every and step % args.eval_every == 0 and step != job.steps:
            record["eval_loss"] = eval_loss(job, args)
        if step == job.steps or (args.save_every and step % args.save_every == 0):
            checkpoint.save(job.engine, job.ckpt_dir, step)
        losses.append(loss)
        if log:
            log.write(record)
        if args.crash_at_step == step and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # testing: a rank dies without cleaning up
    summary = {"steps": job.steps, "start_step": job.start_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "eval_loss": eval_loss(job, args),
               "tokens_per_s": sum(rates) / max(len(rates), 1), "seconds": time.perf_counter() - start,
               "params_per_rank": _params_per_rank(job.engine)}
    if log:
        log.close(summary)
    return summary


def _params_per_rank(engine) -> list:
    """Per global rank, the parameter elements its module holds in memory (a pipeline stage: its
    own layers only; ZeRO-3: its shard is not counted, the placeholders hold 0)."""
    held = sum(p.numel() for p in engine.module.parameters())
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, held)
    return counts


class _Log:
    """Rank 0's output: a tqdm bar (loss, lr, tokens/s) and one JSON line per step."""

    def __init__(self, path: Path, job: Job, progress: bool):
        from tqdm import tqdm

        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self.bar = tqdm(total=job.steps, initial=job.start_step, disable=not progress, unit="step")

    def write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        shown = {k: f"{v:.4g}" for k, v in record.items() if k != "step"}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self, summary: dict):
        self.file.write(json.dumps({"summary": summary}) + "\n")
        self.file.close()
        self.bar.close()
