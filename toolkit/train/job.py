"""What a run's Job is built from once the process group is up: tokenizer, data, model, engine, resume.

A `Job` holds the engine and this rank's data streams, what toolkit.train.loop steps through; `prepare` builds it
(the model and its engine: toolkit.train.engine), resuming from a checkpoint when asked. `run_identity` is what a
resumed run must share with its checkpoint; `stream_position` is a --streaming rank's place in its stream.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from toolkit.distributed.agreement import agree
from toolkit.errors import UnusableInput
from toolkit.files import full_disk_is_one_line
from toolkit.distributed.topology import config_batch
from toolkit.distributed.sequence_parallel import backward_scale
from toolkit import data
from toolkit.data.source import cache_root
from toolkit.checkpoint import manifest
from toolkit.checkpoint.run_folder import RunFolder
from toolkit.train import hf, preference, tf32
from toolkit.train.preference.reference import attach_reference
from toolkit.train.engine import dtype_of, load, model_of_rank, quiet_packed_rows, rank_device, start_engine
from toolkit.train.report.progress import describe, trust_notes


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
    objective: object = None  # --objective dpo: its models.objectives.DpoLoss (a pipeline's loss_fn); None: the LM loss


def prepare(args, cfg: dict, topo, dp_rank: int, resume_tag: str | None = None, clock=None) -> Job:
    """Tokenizer, data, model and engine; resumes from checkpoint `resume_tag` when given. clock: a
    report.StartClock, marked at each phase's end."""
    mark = clock.mark if clock is not None else (lambda phase: None)
    tokenizer, config, prepared = read_inputs(args, cfg, topo)
    mark("data")
    objective = preference.build(args, topo.pp, lora_on(args))
    preference.check_prepared(objective, prepared.info)
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
    model, record = model_of_rank(args, config, topo, cfg, objective)
    mark("model")
    quiet_packed_rows()
    seed_streams(args.seed, dp_rank)
    engine, param_names = start_engine(model, record, cfg, topo, args.verbose)
    mark("engine")
    record, save_frozen = run_record(args, record, topo, cfg)
    with agree("writing the run's record", name_ranks=False):
        if dist.get_rank() == 0 and not resume_tag:
            manifest.save_meta(ckpt_dir, config, tokenizer, record)
    # the reference log-probs: the initial weights', so before a checkpoint is loaded
    staged = SimpleNamespace(engine=engine, pipeline=topo.pp > 1, train=sampler, eval_set=prepared.eval, dp=topo.dp,
                             dp_rank=dp_rank, record=record, objective=objective)
    reference_note = attach_reference(staged, args, cfg)
    if reference_note:
        mark("reference")
    if resume_tag:
        _resume(engine, ckpt_dir, resume_tag, record, save_frozen, args.seed, dp_rank)
        mark("resume")
    steps = args.steps or sampler.steps_per_epoch
    about = describe(args, cfg, topo, batch, engine, record, start, steps,
                     {"tag": resume_tag, "saved": saved, "notes": manifest.resume_notes(
                         saved, record, args.resume_with_new_data) + trust_notes(args)} if resume_tag else None)
    about.update(tf32=tf32_on, tf32_note=tf32_line, startup=clock.phases() if clock is not None else None,
                 objective=preference.opening_line(objective, batch.mbs, reference_note))
    return Job(engine=engine, pipeline=topo.pp > 1, train=sampler, eval_set=staged.eval_set.head(args.max_eval_rows),
               start_step=start, steps=steps, tokens_per_step=batch.gbs * args.seq_len, sp=topo.sp,
               sp_rank=topo.sp_rank(dist.get_rank()), backward_scale=backward_scale(cfg, topo.sp),
               dp=topo.dp, dp_rank=dp_rank, ckpt_dir=ckpt_dir, save_frozen=save_frozen, data_info=prepared.info or stream_info(sampler, prepared),
               param_names=param_names, record=record, about=about, config=cfg, rows_per_step=batch.gbs,
               progress=args.progress, objective=objective)


def lora_on(args) -> bool:
    from toolkit.train.lora import settings_of

    return settings_of(args) is not None


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


def data_options(args, max_positions=None) -> data.DataOptions:
    """The data settings of a run (TrainArgs) for toolkit.data.prepare."""
    return data.DataOptions(path=args.data, seq_len=args.seq_len, task=args.task, format=args.format,
                            text_field=args.text_field, train_on=args.train_on, packing=args.packing,
                            drop_long=args.drop_long, eval_fraction=args.eval_fraction, eval_data=args.eval_data,
                            seed=args.seed, encoding=args.encoding, cache_dir=args.data_cache,
                            workers=args.data_workers, max_positions=max_positions)


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


def run_record(args, record: dict, topo, cfg: dict) -> tuple:
    """(what every checkpoint of the run records: the model's stages and names, run_identity, "portable"; whether
    checkpoints hold the frozen base). LoRA from a local directory: checkpoints hold the adapters, not a
    copy of the frozen base each time (a 7B base is ~14 GB a save); the base is read back from --model on
    resume and export."""
    record["base_saved"] = save_frozen = "lora" not in record or not Path(args.model).is_dir()
    adapters = {"lora_adapters": record["lora"]} if record.get("lora") else {}  # resolved; "lora" becomes the flags
    return {**record, **run_identity(args, topo, cfg), **adapters, "portable": True}, save_frozen


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
    if preference.uses_preference(args):  # another objective trains toward other weights
        identity["data"]["objective"] = {"objective": args.objective, "beta": args.dpo_beta, "loss": args.dpo_loss}
    if args.streaming:  # another order of rows (this rank's share, file order): not a non-streaming run's to resume
        identity["data"]["streaming"] = True
    if args.hub_ids:  # recorded, not compared: "model" and "tokenizer" are their snapshot folders (one commit)
        identity["hub"] = {**args.hub_ids, "--revision": args.revision}
    if topo is not None:
        zero = (cfg or {}).get("zero_optimization") or {}
        identity.update(pp=topo.pp, dp=topo.dp, tp=topo.tp, sp=topo.sp, zero_stage=zero.get("stage", 0))
        if ((cfg or {}).get("expert_parallel") or {}).get("enabled") is True:  # DeepSpeed's AutoEP
            from toolkit.distributed.topology import ep_of

            identity["expert_parallel"] = ep_of(cfg)
        if topo.pp > 1 and args.schedule != "1f1b":  # absent: 1f1b (manifest.LAYOUT_DEFAULTS)
            identity["schedule"] = args.schedule
    return identity


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
