"""The reference log-probs without a second model (TRL's precompute_ref_log_probs): one pass over the training and eval
pairs with the weights as built, before step 1 and before a resume loads a checkpoint, so they are the initial
model's whatever the run has trained since. LoRA's B is zero at init, so a LoRA pipeline's initial model is its base.

Cached beside the prepared data (--data-cache) under a key of the rows (their datasets fingerprints, which hold the
data, tokenizer, format and seq-len) and the model (its folder's files by size and time, or a built-in's name and
seed; the precision and attention kernel): a resume, or a move to another layout, reads them back. Every rank takes
part in the pass (a pipeline's stages all run it); each row's value comes from the one rank that scored it,
summed over the world.
"""

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

VERSION = 1  # bump when the values change for the same key


def attach_reference(job, args, cfg: dict) -> str:
    """job.train.data and job.eval_set with their reference log-probs (unless the objective computes them live);
    returns what the opening block says about them."""
    objective = job.objective
    if objective is None or objective.live_reference:
        return ""
    from toolkit.data.source import cache_root

    train, held = job.train.data, job.eval_set
    path = cache_root(args.data_cache) / f"dpo-reference-{cache_key(train, held, args, cfg)}.pt"
    found = read_cached(path, len(train.rows), len(held.rows))
    have = torch.tensor([0.0 if found is None else 1.0], device=job.engine.device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)  # every rank runs the pass, or none
    if have.item():
        how = f"the initial weights' log-probs, read from {path.name}"
    else:
        found = {"train": scores(job, train), "eval": scores(job, held)}
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write_cached(path, found)
        how = f"the initial weights' log-probs, computed before step 1 and cached as {path.name}"
    job.train.data = train.with_reference(found["train"])
    job.eval_set = held.with_reference(found["eval"])
    return how


def cache_key(train, held, args, cfg: dict) -> str:
    from toolkit.train.engine import dtype_of

    folder = Path(args.model)
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
                   if p.suffix in (".safetensors", ".json", ".bin")) if folder.is_dir() else None
    model = {"model": str(folder.resolve()) if folder.is_dir() else args.model, "files": files,
             "seed": None if folder.is_dir() else args.seed, "dtype": dtype_of(cfg), "attention": args.attention,
             "task": args.task}
    rows = [train.rows.ds._fingerprint, held.rows.ds._fingerprint, len(train.rows), len(held.rows)]
    return hashlib.sha256(json.dumps([VERSION, rows, model], default=str).encode()).hexdigest()[:32]


def scores(job, pairs) -> torch.Tensor:
    """(2N,) float32 on the host: each row's completion log-prob under the engine's weights as they are now."""
    from toolkit import data
    from toolkit.data.pairs import pair_rows

    mbs, n = job.train.mbs, len(pairs)  # pairs per micro-batch
    count = data.eval_batch_count(n, mbs, job.dp)
    if job.pipeline and (job.record or {}).get("schedule") == "dualpipev":
        count = -(-count // job.engine.micro_batches) * job.engine.micro_batches  # eval_batch takes gas at a time
    mine = list(range(job.dp_rank, n, job.dp))
    batches = _told(data.eval_micro_batches(pairs, mbs, job.dp, job.dp_rank, count), n, job.dp)
    values = _pipeline_pass(job, batches, count) if job.pipeline else _plain_pass(job, batches)
    out = torch.zeros(2 * n, dtype=torch.float64, device=job.engine.device)
    for k, logps in enumerate(values):  # the loss stage's (pipelines), every rank's at pp 1
        idx = mine[k * mbs: (k + 1) * mbs]
        if idx:
            out[torch.as_tensor(pair_rows(idx), device=out.device)] = logps[: 2 * len(idx)].double().to(out.device)
    dist.all_reduce(out)
    return out.float().cpu()


def _told(batches, pairs: int, dp: int):
    """The micro-batches, with rank 0's progress line over a long pass (about every 30 s in a log, as tokenizing
    says; nothing for one that ends sooner)."""
    from toolkit.data.tokens import Progress

    progress = Progress(f"reference log-probs: {pairs:,} pairs", 2 * pairs) if dist.get_rank() == 0 else None
    for batch in batches:
        if progress is not None:
            progress.update(batch[0][0].shape[0] * dp, batch[0][0].numel() * dp)
        yield batch
    if progress is not None and progress.last != progress.start:  # it said something: say it ended
        progress.close()


def _plain_pass(job, batches) -> list:
    from models.attention import model_inputs
    from models.objectives import sequence_logps
    from toolkit.data.transfer import to_device

    engine, out = job.engine, []
    engine.eval()
    with torch.no_grad():
        for (input_ids, doc_ids), (labels, _) in batches:
            inputs = to_device({"input_ids": input_ids, **model_inputs(doc_ids, engine.module.config)}, engine.device)
            out.append(sequence_logps(engine(**inputs).logits, labels.to(engine.device)))
    engine.train()
    return out


def _pipeline_pass(job, batches, count: int) -> list:
    from toolkit.data.transfer import to_device

    engine, objective = job.engine, job.objective
    chunk = engine.micro_batches if (job.record or {}).get("schedule") == "dualpipev" else count
    stream = (to_device(b, engine.device) for b in batches)
    objective.collect = []
    try:
        for _ in range(count // chunk):
            engine.eval_batch(stream, reduce_output=None, bcast_loss=False, num_micro_batches=chunk)
        return objective.collect
    finally:
        objective.collect = None


def read_cached(path: Path, train_rows: int, eval_rows: int) -> dict | None:
    try:
        found = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):
        return None
    ok = isinstance(found, dict) and getattr(found.get("train"), "shape", None) == (train_rows,) and getattr(
        found.get("eval"), "shape", None) == (eval_rows,)
    return found if ok else None


def write_cached(path: Path, found: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(found, tmp)
    os.replace(tmp, path)  # whole or absent: a reader never sees half of it
