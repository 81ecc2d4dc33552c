"""What toolkit.train runs once the process group is up: data, engine, the step loop.

A `Job` holds the engine and this rank's data streams. `train_step` is one optimizer step of
gbs rows: train_batch() for a pipeline, gas forward/backward/step calls for pp = 1.
"""

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.distributed.agreement import agree
from toolkit.distributed.process_group import all_reduce_sum
from toolkit.errors import ConfigError, UnusableInput
from toolkit.files import full_disk_is_one_line
from toolkit.distributed.topology import config_batch
from toolkit.distributed.sequence_parallel import backward_scale
from toolkit import data
from toolkit.data.source import cache_root
from toolkit.data.transfer import to_device
from toolkit.checkpoint import manifest
from toolkit.checkpoint.run_folder import RunFolder
from models.weights import loading
from toolkit.train import hf, tf32
from toolkit.train.engine import initialize, load
from toolkit.train.report import ProgressLog, memory, per_rank
from toolkit.train.report.summary import throughput
from toolkit.train.report.step_stats import StepStats


@dataclass(kw_only=True)
class Job:
    """What the step loop needs of a prepared run (built by name, in `prepare`)."""

    engine: object
    pipeline: bool
    train: data.ShardedBatches
    eval_set: data.Rows
    start_step: int
    steps: int
    tokens_per_step: int  # gbs * seq_len
    dp: int
    dp_rank: int
    ckpt_dir: Path
    sp: int = 1  # Ulysses: the sp ranks of a group share rows, each with its 1/sp of the sequence
    sp_rank: int = 0
    backward_scale: int = 1  # sp under ZeRO-3 (toolkit.distributed.sequence_parallel.backward_scale)
    save_frozen: bool = True  # False: a LoRA run from a directory saves adapters (and optimizer) only
    data_info: dict | None = None  # data.Prepared.info: format, documents, rows, truncations
    param_names: list | None = None  # this rank's optimizer parameters by name, per group (saved with its states)
    record: dict | None = None  # the run's manifest (dstk/manifest.json), also saved with every tag (a run can change layout)
    about: dict | None = None  # what rank 0's opening block says (report.start_lines), also in the summary
    config: dict | None = None  # the DeepSpeed config (the trackers' hyperparameters)
    rows_per_step: int = 0  # gbs
    progress: bool = True  # rank 0's progress lines (--progress)


def prepare(args, cfg: dict, topo, dp_rank: int, resume_tag: str | None = None, clock=None) -> Job:
    """Tokenizer, data, model and engine; resumes from checkpoint `resume_tag` when given. clock: a
    report.StartClock, marked at each phase's end."""
    mark = clock.mark if clock is not None else (lambda phase: None)
    tokenizer, config, prepared = read_inputs(args, cfg, topo)
    mark("data")
    batch = config_batch(cfg, topo.dp)
    ckpt_dir = RunFolder(args.out).checkpoints
    with agree("setting up this rank's data"):  # each rank opens its own share of a stream, reads its own position
        if args.streaming:
            from toolkit.data.stream import StreamBatches

            opts = data_options(args, hf.max_positions(config))
            sampler = StreamBatches(opts, tokenizer, batch.mbs, batch.gas, topo.dp, dp_rank)
        else:
            sampler = data.ShardedBatches(prepared.train, batch.mbs, batch.gas, topo.dp, dp_rank, args.seed)
        start = manifest.step_of(resume_tag) if resume_tag else 0  # a foreign tag is refused before the build
        saved = manifest.read_manifest(ckpt_dir, resume_tag) if resume_tag else None  # before a move rewrites it
        if resume_tag:
            manifest.check_same_model(ckpt_dir, config)
            if args.streaming:  # the next unseen row of this rank's share
                sampler.resume_from(stream_position(ckpt_dir / resume_tag, saved, topo, dist.get_rank()))
    tf32_on, tf32_line = tf32.apply(args.tf32, rank_device(), dtype_of(cfg))  # before the model's first matmul
    model, record = model_of_rank(args, config, topo, cfg)
    mark("model")
    _quiet_packed_rows()
    seed_streams(args.seed, dp_rank)
    engine, param_names = start_engine(model, record, cfg, topo, args.verbose)
    mark("engine")
    record, save_frozen = run_record(args, record, topo, cfg)
    with agree("writing the run's record", name_ranks=False):
        if dist.get_rank() == 0 and not resume_tag:
            manifest.save_meta(ckpt_dir, config, tokenizer, record)
    if resume_tag:
        _resume(engine, ckpt_dir, resume_tag, record, save_frozen, args.seed, dp_rank)
        mark("resume")
    steps = args.steps or sampler.steps_per_epoch
    about = describe(args, cfg, topo, batch, engine, record, start, steps,
                     {"tag": resume_tag, "saved": saved, "notes": manifest.resume_notes(
                         saved, record, args.resume_with_new_data) + trust_notes(args)} if resume_tag else None)
    about.update(tf32=tf32_on, tf32_note=tf32_line, startup=clock.phases() if clock is not None else None)
    return Job(engine=engine, pipeline=topo.pp > 1, train=sampler, eval_set=prepared.eval.head(args.max_eval_rows),
               start_step=start, steps=steps, tokens_per_step=batch.gbs * args.seq_len, sp=topo.sp,
               sp_rank=topo.sp_rank(dist.get_rank()), backward_scale=backward_scale(cfg, topo.sp),
               dp=topo.dp, dp_rank=dp_rank, ckpt_dir=ckpt_dir, save_frozen=save_frozen, data_info=prepared.info or stream_info(sampler, prepared),
               param_names=param_names, record=record, about=about, config=cfg, rows_per_step=batch.gbs,
               progress=args.progress)


def trust_notes(args) -> list:
    """The opening block's word on --trust-checkpoint: the checkpoint was loaded as pickles, unchecked."""
    if not args.trust_checkpoint:
        return []
    return ["--trust-checkpoint: the checkpoint's .pt files were loaded as pickles (torch.load weights_only=False), "
            "unchecked: any code in them ran"]


def describe(args, cfg: dict, topo, batch, engine, record: dict, start: int, steps: int, resume) -> dict:
    """What the run is, for rank 0's opening block and the summary: model, dtype, layout, batch,
    parameters (counted over the world: a collective, every rank calls it), LoRA, resume."""
    from toolkit.train.report.footprint import parameter_counts

    params, trainable = parameter_counts(engine, topo, record)
    dtype = dtype_of(cfg)
    name = (args.hub_ids or {}).get("--model") or Path(args.model).name or args.model  # a hub id, not its commit
    return {"model": args.model, "model_name": name, "from_dir": Path(args.model).is_dir(),
            "seed": args.seed, "dtype": dtype, "params": params, "trainable": trainable,
            "layout": {"dp": topo.dp, "pp": topo.pp, "tp": topo.tp, "sp": topo.sp,
                       "schedule": args.schedule if topo.pp > 1 else None,  # pp 1 runs no pipeline schedule
                       "zero_stage": (cfg.get("zero_optimization") or {}).get("stage", 0)},
            "mbs": batch.mbs, "gas": batch.gas, "gbs": batch.gbs, "seq_len": args.seq_len,
            "lora": record.get("lora_adapters") or record.get("lora"), "start_step": start, "steps": steps,
            "resume": resume}


def dtype_of(cfg: dict) -> str:
    """The run's precision as the opening block names it: bf16, fp16 or fp32 (loading.param_dtype: as DeepSpeed
    reads the config, its old "bfloat16" key included)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(loading.param_dtype(cfg), "fp32")


def rank_device():
    """The device this rank's engine will use: the GPU process_group.init selected, else the CPU."""
    from toolkit.distributed.process_group import engine_args

    chosen = engine_args()
    return torch.device("cpu") if chosen is None else torch.device("cuda", chosen.device_rank)


def read_inputs(args, cfg: dict, topo) -> tuple:
    """(tokenizer, HF config, data.Prepared): the run's tokenizer, its model's config (checked for tp > 1;
    a classifier's num_labels from the data) and its tokenized rows."""
    with agree("reading the tokenizer and the model's config"):  # each rank reads its node's files
        tokenizer = hf.load_tokenizer(args.model, args.tokenizer, args.chat_template)
        config = hf.load_config(args.model, tokenizer, args.task, attention=args.attention)
        hf.check_model_class(args.model, config, args.task)
        if topo.tp > 1:
            section = cfg.get("tensor_parallel") or {}
            hf.check_tensor_parallel(config, topo.tp, custom_plan=bool(section.get("preset_model")
                                                                       or section.get("partition_config")))
    opts = data_options(args, hf.max_positions(config))
    with full_disk_is_one_line(cache_root(opts.cache_dir), "tokenizing into the data cache",
                               "nothing of the run is written yet: free space there, or give --data-cache a folder on "
                               "a disk with room"):
        prepared = data.prepare_once_per_node(opts, tokenizer) if not args.streaming else eval_only(opts, tokenizer)
    if args.task == "sequence-classification":
        config.num_labels = prepared.info["num_labels"]  # the head's size, from the data
    return tokenizer, config, prepared


def stream_info(sampler, prepared: data.Prepared) -> dict | None:
    """A --streaming run's data line and summary "data": what the stream is (its `position`, where it got to, is
    added at the end), with the eval rows of --eval-data."""
    info = getattr(sampler, "info", None)
    return None if info is None else {**info, "eval_rows": len(prepared.eval)}


def eval_only(opts: data.DataOptions, tokenizer) -> data.Prepared:
    """--streaming: --data is read by toolkit.data.stream; the eval rows are --eval-data's, prepared as usual (train
    rows of a preparation of that file alone), or none. info: None (no line about data read ahead)."""
    from dataclasses import replace

    if not opts.eval_data:
        empty = torch.zeros(0, opts.seq_len, dtype=torch.long)
        return data.Prepared(None, data.TokenData(empty, empty, empty), None)
    held = data.prepare_once_per_node(replace(opts, path=opts.eval_data, eval_data=None, eval_fraction=0.0), tokenizer)
    return data.Prepared(None, held.train, None)


def model_of_rank(args, config, topo, cfg: dict):
    """make_model, with a refusal that names this rank: each stage reads its own tensors, so this rank
    may be the only one failing."""
    try:
        return make_model(args, config, topo, cfg)
    except ConfigError as exc:
        stage = topo.coords(dist.get_rank())[0]
        failed = type(exc)(f"rank {dist.get_rank()} (pipeline stage {stage}): {exc}")
        failed.every_rank = True  # printed by the rank that hit it, not only by rank 0
        raise failed from None


def start_engine(model, record: dict, cfg: dict, topo, verbose: bool = False) -> tuple:
    """(DeepSpeed engine, this rank's optimizer parameters by name per group). The names are taken in the
    optimizer's order before initialize replaces the parameters under bf16: how export finds pp = 1 fp32
    masters, and how torch's optimizer state is named when the run moves to another layout."""
    groups = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    param_names = [[names[id(p)] for p in g["params"]] for g in groups]
    if topo.pp == 1:
        record["param_groups"] = param_names
    mpu = None
    config = (getattr(model, "config", None) or model.get_base_model().config) if topo.pp == 1 else None
    if topo.sp > 1 and topo.pp == 1:  # Ulysses' groups and attention before the engine, which takes the groups as
        from toolkit.distributed.sequence_parallel import UlyssesGroups, register  # its mpu (pipelines: pipeline.py)

        mpu = UlyssesGroups(register(config, topo.sp, config_batch(cfg, topo.dp).mbs))
    elif topo.pp == 1:  # HF's masks (padded or packed rows) built additive: one per micro-batch for all layers
        from models.attention import share_additive_masks

        share_additive_masks(config)
    return initialize(model, groups, deepspeed_config(cfg, topo), verbose=verbose, mpu=mpu), param_names


def run_record(args, record: dict, topo, cfg: dict) -> tuple:
    """(what every checkpoint of the run records: the model's stages and names, run_identity, "portable"; whether
    checkpoints hold the frozen base). LoRA from a local directory: checkpoints hold the adapters, not a
    copy of the frozen base each time (a 7B base is ~14 GB a save); the base is read back from --model on
    resume and export."""
    record["base_saved"] = save_frozen = "lora" not in record or not Path(args.model).is_dir()
    adapters = {"lora_adapters": record["lora"]} if record.get("lora") else {}  # resolved; "lora" becomes the flags
    return {**record, **run_identity(args, topo, cfg), **adapters, "portable": True}, save_frozen


def seed_streams(seed: int, dp_rank: int, step: int = 0) -> None:
    """Seed torch's generators (dropout) from here on: another stream per data-parallel replica, which
    its pipeline stages and tp ranks share. A run that resumes on another layout, whose saved states
    belong to the old layout's ranks, re-seeds from the step it continues (in the high bits: no stream
    of a fresh start), so its losses are deterministic but not the uninterrupted run's."""
    torch.manual_seed(seed + 1 + dp_rank + (step << 32))


def _resume(engine, ckpt_dir: Path, tag: str, record: dict, save_frozen: bool, seed: int, dp_rank: int) -> None:
    """Load checkpoint `tag` into the engine: DeepSpeed's own load on the layout it was written with,
    with each rank's random-number generators; on another layout (or from `dstk reshard`'s portable
    folder) by HF name (toolkit.checkpoint.portable), after which the run's manifest describes the new layout (each
    older tag keeps its own copy), and the generators re-seeded (seed_streams)."""
    from toolkit.checkpoint import portable

    saved = manifest.read_manifest(ckpt_dir, tag)
    if portable.moved(saved, record) or portable.is_portable(ckpt_dir / tag):
        made = portable.stage(ckpt_dir, tag)
        names = portable.hf_names_of(engine.module, record)
        with agree("reading the checkpoint on the new layout"):  # each rank its own tensors
            portable.restore(engine, portable.read(ckpt_dir, tag, wanted=set(names.values())), names)
        with agree("recording the new layout", name_ranks=False):
            if dist.get_rank() == 0:
                manifest.move_manifest(ckpt_dir, record)
                if made:  # the tag is as it was written
                    shutil.rmtree(ckpt_dir / tag / portable.PORTABLE)
        seed_streams(seed, dp_rank, manifest.step_of(tag))
        return
    # without the base (LoRA from a directory, QLoRA) the module loads non-strictly: the frozen base was
    # just read from --model, and only the adapters come from the checkpoint
    loaded = load(engine, ckpt_dir, tag, strict=save_frozen)
    with agree("loading the checkpoint"):
        if loaded is None:  # DeepSpeed only warns and goes on with the fresh weights
            raise UnusableInput(f"--resume: {ckpt_dir / tag} could not be loaded (files missing on rank "
                                f"{dist.get_rank()}?); nothing was trained. Check the folder, or start a fresh --out")
        if not manifest.load_rng(ckpt_dir / tag, dist.get_rank()):  # a tag written before dstk saved them
            seed_streams(seed, dp_rank, manifest.step_of(tag))


def stream_position(tag_dir: Path, saved: dict, topo, rank: int) -> dict:
    """Rank `rank`'s place in the stream of a --streaming run's checkpoint (toolkit.data.stream): its data-parallel
    replica's. Every rank saves its own position, but only the ranks that load micro-batches advance theirs (1F1B:
    the first and last stages; DualPipeV: pipe rank 0), so a replica's place is the farthest its ranks saved,
    whatever their stage: found by replica, it holds on another pp, tp, sp or schedule. The shares are rows
    i % dp == dp_rank: another dp is refused, naming both layouts, in the same words on every rank."""
    _, dp_rank = topo.coords(rank)
    files = sorted(tag_dir.glob(manifest.DATA_POSITION.format("*")))
    if not files:
        return manifest.load_data_position(tag_dir, rank)  # refused: not a --streaming run's checkpoint
    positions = [json.loads(f.read_text()) for f in files]
    mine = [p for p in positions if (p.get("dp"), p.get("dp_rank")) == (topo.dp, dp_rank)]
    if mine:
        return max(mine, key=lambda p: (p["pass"], p["docs"], p["rows"]))
    was = _layout_words(*(int(saved.get(k, 1)) for k in ("dp", "pp", "tp", "sp")))  # older runs: no sp
    now = _layout_words(topo.dp, topo.pp, topo.tp, topo.sp)
    raise UnusableInput(f"--resume --streaming: {tag_dir.name} was saved on {was}; a --streaming run's place in its "
                        f"stream is kept per data-parallel replica (rows i % dp), so it resumes with dp "
                        f"{positions[0].get('dp')}, not {topo.dp} ({now}): keep dp {positions[0].get('dp')} (pp, tp "
                        "and sp may change), or start afresh in another --out")


def _layout_words(dp: int, pp: int, tp: int, sp: int) -> str:
    ranks = dp * pp * tp * sp
    return f"dp {dp} x pp {pp} x tp {tp} x sp {sp}, {ranks} rank{'s' if ranks > 1 else ''}"


def data_options(args, max_positions=None) -> data.DataOptions:
    """The data settings of a run (TrainArgs) for toolkit.data.prepare."""
    return data.DataOptions(path=args.data, seq_len=args.seq_len, task=args.task, format=args.format,
                            text_field=args.text_field, train_on=args.train_on, packing=args.packing,
                            drop_long=args.drop_long, eval_fraction=args.eval_fraction, eval_data=args.eval_data,
                            seed=args.seed, encoding=args.encoding, cache_dir=args.data_cache,
                            workers=args.data_workers, max_positions=max_positions)


NEVER_PRINT = 2**62  # steps_per_print that no run reaches (None would be `global_steps % None` in the engine)


def deepspeed_config(cfg: dict, topo) -> dict:
    """The dict deepspeed.initialize gets. Under AutoTP (tp > 1) without train_batch_size: DeepSpeed 0.19
    checks it against mbs x gas x the WORLD size (runtime/config.py:471) before its tp groups exist, so
    the right value (mbs x gas x dp, checked by dstk) would stop it; it derives one from the other two.
    With pipeline stages also without "tensor_parallel": dstk shards the stages itself (toolkit.train.
    distributed/tensor_parallel.py), and DeepSpeed's own AutoTP would replace the pipeline grid by a mesh without a pipe axis.
    sp inside pipeline stages: without train_batch_size and sequence_parallel_size, as the engine's grid counts a
    stage's dp x sp ranks as replicas (toolkit.distributed.sequence_parallel); dstk checked gbs = mbs x gas x dp.
    Pipelines: DeepSpeed's PipelineEngine prints its own "steps: N loss: ..." line every steps_per_print steps
    (a bare print on rank 0, pipe/engine.py, beside dstk's step lines); steps_per_print is set past any run's
    length so it never does (its other use, the engine's wall-clock report, is off unless asked for)."""
    if topo.pp > 1:
        cfg = {**cfg, "steps_per_print": NEVER_PRINT}
    if topo.sp > 1 and topo.pp > 1:  # DeepSpeed's grid holds a stage's dp x sp ranks as data-parallel ones
        return {k: v for k, v in cfg.items() if k not in ("train_batch_size", "sequence_parallel_size")}
    if topo.tp == 1:
        return cfg
    dropped = ("train_batch_size", "tensor_parallel") if topo.pp > 1 else ("train_batch_size",)
    return {k: v for k, v in cfg.items() if k not in dropped}


def param_groups(model, cfg: dict) -> list:
    """The trainable parameters in two groups, as the HF Trainer makes them: weight decay on the
    matrices of linear layers, none on biases, norms and embeddings (decaying a norm's gain or an
    embedding row pulls it toward zero for no regularising benefit)."""
    decay = ((cfg.get("optimizer") or {}).get("params") or {}).get("weight_decay", 0.0)
    no_decay = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) or "norm" in type(m).__name__.lower()
                for p in m.parameters(recurse=False)}
    groups = [{"params": [], "weight_decay": decay}, {"params": [], "weight_decay": 0.0}]
    for name, p in model.named_parameters():
        if p.requires_grad:
            matrix = len(getattr(p, "ds_shape", p.shape)) >= 2  # ZeRO-3 partitions keep their shape in ds_shape
            groups[0 if matrix and id(p) not in no_decay else 1]["params"].append(p)
    return [g for g in groups if g["params"]]


def run_identity(args, topo=None, cfg: dict | None = None) -> dict:
    """What a resumed run must share with the checkpoint it continues (manifest.RUN_KEYS), and its layout
    (with `topo` and `cfg`). "data" holds every input of the token stream: another file, format, template,
    --train-on, tokenizer file or seed would resume mid-epoch on other tokens; each file by its content
    (toolkit.data.fingerprint: one edited in place is another input, one moved the same)."""
    def where(path):
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    from toolkit.data.fingerprint import digest, of_input
    from toolkit.train.hf import TOKENIZER_FILES
    from toolkit.train.lora import settings_of

    settings = settings_of(args)
    tokenizer_dir = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
    identity = {"model": where(args.model), "tokenizer": where(args.tokenizer), "task": args.task,
                "seq_len": args.seq_len, "lora": settings.to_dict() if settings else None,
                "data": {"path": where(args.data), "format": args.format, "packing": args.packing,
                         "eval_fraction": args.eval_fraction, "eval_data": where(args.eval_data), "seed": args.seed,
                         "train_on": args.train_on, "text_field": args.text_field, "encoding": args.encoding,
                         "chat_template": digest([args.chat_template]) if args.chat_template else None,
                         "tokenizer_files": digest([Path(tokenizer_dir) / name for name in TOKENIZER_FILES])
                         if tokenizer_dir else None,
                         "content": {"--data": of_input(args.data, args.data_cache, args.streaming),
                                     "--eval-data": of_input(args.eval_data, args.data_cache)}}}
    if args.streaming:  # another order of rows (this rank's share, file order): not a non-streaming run's to resume
        identity["data"]["streaming"] = True
    if args.hub_ids:  # recorded, not compared: "model" and "tokenizer" are their snapshot folders (one commit)
        identity["hub"] = {**args.hub_ids, "--revision": args.revision}
    if topo is not None:
        zero = (cfg or {}).get("zero_optimization") or {}
        identity.update(pp=topo.pp, dp=topo.dp, tp=topo.tp, sp=topo.sp, zero_stage=zero.get("stage", 0))
        if topo.pp > 1 and args.schedule != "1f1b":  # absent: 1f1b (manifest.LAYOUT_DEFAULTS)
            identity["schedule"] = args.schedule
    return identity


def make_model(args, config, topo, cfg: dict):
    """(model for deepspeed.initialize, its part of the manifest). pp > 1 with a local directory: no rank builds the
    whole model; each stage reads its own layers' tensors (toolkit.distributed.pipeline)."""
    from models.lora import adapters
    from toolkit.train import lora

    settings = lora.settings_of(args)
    checkpointing = "activation_checkpointing" in cfg  # DeepSpeed's section configures an API HF models never call
    if topo.pp == 1:
        if settings is not None and settings.qlora:
            torch.manual_seed(args.seed)
            compute = str(loading.param_dtype(cfg)).removeprefix("torch.")  # the run's precision: fp16 computes in fp16
            model = lora.quantized_model(args.model, config, args.task, compute, checkpointing)
        else:
            model = loading.build_model(args.model, config, args.task, args.seed, cfg)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings is None:
            return model, {"pp": 1}
        entry = adapters.manifest_entry(settings, model, args.task)
        return adapters.apply(model, settings, args.task, args.seed), {"pp": 1, "lora": entry}
    from toolkit.distributed.pipeline import pipeline_module

    if Path(args.model).is_dir():
        torch.manual_seed(args.seed)  # heads the directory lacks: the same init on every dp replica
        source = args.model
    else:  # built-in: tiny, random from the seed, identical on every rank and layout
        source = loading.build_model(args.model, config, args.task, args.seed)  # tiny: no ZeRO-3 at pp > 1
        if settings is not None:
            source = adapters.apply(source, settings, args.task, args.seed).base_model.model  # the HF model inside
    return pipeline_module(source, args.task, topo, cfg, seq_len=args.seq_len, config=config, verbose=args.verbose,
                           lora=settings, seed=args.seed, schedule=args.schedule)


def train_step(job: Job, it) -> float:
    """One optimizer step; returns the loss averaged over micro-batches and dp replicas."""
    if job.pipeline:
        return float(job.engine.train_batch(it))
    losses = []
    for _ in range(job.engine.gradient_accumulation_steps()):
        loss = forward_loss(job.engine, next(it), job.sp, job.sp_rank)
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


def forward_loss(engine, batch, sp: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """pp = 1: the HF model on a batch whose second tensor holds document ids (packed rows: positions
    restart and attention stays inside each document, models.attention.model_inputs, built on the host:
    no device sync). DeepSpeedEngine.forward does not move inputs (only the PipelineEngine does).
    sp > 1: this rank's slice of the sequence; its loss is its share of the micro-batch's mean, the sp
    group's shares summing to it (toolkit.distributed.sequence_parallel). Every tensor reaches the device through
    to_device: non-blocking, from pinned memory on CUDA, on the stream the forward then runs on."""
    from models.attention import model_inputs

    if sp > 1:
        from toolkit.distributed.sequence_parallel import shard

        return engine(**to_device(shard(batch, sp, sp_rank), engine.device)).loss
    (input_ids, doc_ids), labels = batch
    if labels.dim() == 1:  # a classifier (BERT): never packed, a padding mask
        inputs = {"attention_mask": doc_ids}
    else:
        inputs = model_inputs(doc_ids, engine.module.config)
    return engine(**to_device({"input_ids": input_ids, "labels": labels, **inputs}, engine.device)).loss


class _NoPaddingMaskWarning:
    """Packed rows pass attention_mask=None on purpose (positions carry the documents): HF's advice to
    pass a padding mask then does not apply."""

    @staticmethod
    def filter(record) -> bool:
        return "strongly recommend passing in an `attention_mask`" not in record.getMessage()


def _quiet_packed_rows() -> None:
    import logging

    logging.getLogger("transformers.modeling_utils").addFilter(_NoPaddingMaskWarning)


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
            losses = [float(forward_loss(job.engine, b, job.sp, job.sp_rank)) for b in batches()]
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
                  "tokens_per_s": job.tokens_per_step / seconds, "samples_per_s": job.rows_per_step / seconds}
        if args.eval_every and step % args.eval_every == 0 and step != job.steps and len(job.eval_set) and not stopped_by:
            with section(watchdog, f"evaluating after step {step}"):
                record["eval_loss"] = eval_loss(job)
            record["eval_ppl"] = _perplexity(record["eval_loss"])
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
    summary = {"steps": job.steps, "start_step": job.start_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "eval_loss": final_eval,
               "eval_ppl": _perplexity(final_eval), "data": _data_summary(job),
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
