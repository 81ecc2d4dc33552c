"""The program every rank runs. Any of these starts it (the config decides the layout):

    ./launch.sh --num-gpus 2 --config ds.json -- --model tiny-gpt2 --data corpus.txt --steps 50
    deepspeed --num_gpus 2 --module toolkit.train --config ds.json --model tiny-gpt2 --data corpus.txt
    torchrun --nproc-per-node 2 -m toolkit.train --config ds.json --model tiny-gpt2 --data corpus.txt

pp = 1: the HF model itself under deepspeed.initialize (ZeRO 1/2/3 apply). pp > 1: the model's
layer list (models/) as a PipelineModule over PipeDataParallelTopology(pp, dp), stepped with
train_batch(). Every rank checks the config against the real world size before building anything.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from models import task_named
from toolkit.distributed import process_group
from toolkit.errors import ConfigError, UnusableInput
from toolkit.distributed.topology import Topology, sp_of, tp_of


@dataclass
class TrainArgs:
    model: str  # local HF directory, a built-in name (toolkit.plan.arch.BUILTINS), or a hub id (org/name)
    data: str  # a local file or save_to_disk folder (see toolkit.data)
    config: str  # DeepSpeed JSON
    out: str = "runs/dstk"  # out/checkpoints (DeepSpeed's), out/hf (the export), out/metrics.jsonl
    tokenizer: str | None = None  # a local directory or a hub id
    revision: str = "main"  # of a hub id in --model / --tokenizer: a branch, tag or commit
    hub_ids: dict | None = None  # {"--model": "org/name", ...}: the ids local_inputs replaced by their folders
    task: str = "causal-lm"  # or "sequence-classification" (models.TASKS; "classification" is read as it)
    objective: str = "lm"  # "lm": the task's own loss; "dpo": preference pairs (toolkit.train.preference)
    dpo_beta: float = 0.1  # DPO's beta: the strength of the pull toward the reference
    dpo_loss: str = "sigmoid"  # models.objectives.LOSSES
    pp: int | None = None  # pipeline stages; default: the config's pipeline.stages, else 1
    sp: int | None = None  # Ulysses sequence-parallel size; default: the config's sequence_parallel_size, else 1
    schedule: str = "1f1b"  # pipeline schedule at pp > 1: "1f1b" or "dualpipev" (toolkit.distributed.dualpipev)
    seq_len: int = 128
    steps: int | None = None  # optimizer steps; default: one epoch
    eval_every: int = 0  # 0: only at the end
    eval_batches: int | None = None  # deprecated, ignored: evaluation covers the whole eval split
    save_every: int = 0  # 0: only at the end
    resume: bool = False
    trust_checkpoint: bool = False  # --resume loads the checkpoint's pickles unchecked (toolkit.checkpoint.safe_load)
    resume_with_new_data: bool = False  # --resume although the token stream changed (data, template, tokenizer...)
    overwrite: bool = False  # clear a used --out first
    seed: int = 1234
    eval_fraction: float = 0.05
    text_field: str = "text"
    format: str = "auto"  # toolkit.data.formats.FORMATS, or auto: from the columns
    train_on: str = "assistant"  # or "all"
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template
    packing: bool | None = None  # None: on for text, off for supervised formats
    drop_long: bool = False  # drop rows longer than seq_len instead of truncating them
    eval_data: str | None = None  # a file to evaluate on instead of a share of --data
    data_cache: str | None = None  # where tokenized rows are cached (None: HF_DATASETS_CACHE)
    data_workers: int | None = None  # tokenizing threads; None: the cores, at most 8
    attention: str = "sdpa"  # eager | sdpa | flash_attention_2 (CUDA + flash-attn)
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (CUDA, Ampere and later; toolkit.train.tf32)
    lora: bool = False  # adapters through peft; the base frozen (toolkit.train.lora)
    lora_r: int = 16
    lora_alpha: int | None = None  # None: 2 r
    lora_dropout: float = 0.0
    lora_targets: str | None = None  # comma-separated module names; None: every block linear
    qlora: bool = False  # LoRA on a 4-bit NF4 base (bitsandbytes; CUDA, pp 1)
    encoding: str = "utf-8"  # of --data
    export: bool = True
    progress: bool = True
    max_eval_rows: int | None = None  # evaluate on the eval split's first N rows (HF: max_eval_samples); None: all
    log_every: int = 0  # steps between plain progress lines (0: about 20 per run)
    verbose: bool = False  # DeepSpeed INFO logs and every rank's output
    report_to: tuple = ()  # experiment trackers: tensorboard, wandb, mlflow, all, none (report.trackers)
    streaming: bool = False  # read --data as a stream (toolkit.data.stream), not prepared and cached ahead
    tiled_loss: str = "auto"  # the causal LM loss in tiles of tokens (models.tiled.loss): auto, on, off
    tiled_mlp: str = "auto"  # the blocks' MLPs through DeepSpeed's TiledMLP (models.tiled.mlp): auto, on, off
    offload_activations: str = "auto"  # checkpointed block inputs to host memory (models.tiled.offload): auto, on, off
    step_timeout: float | None = None  # seconds a step, eval or save may take before the rank ends (resilience)
    save_on_signal: bool = False  # SIGUSR1 / SIGTERM: finish the step, save, stop (resilience.SignalStop)
    crash_at_step: int | None = None  # testing: SIGKILL the last rank after this step
    crash_in_step: int | None = None  # testing: SIGKILL the last rank inside this step
    stall_at_step: int | None = None  # testing: the last rank sleeps inside this step

    def __post_init__(self):
        self.task = task_named(self.task)  # one word per task from here on (and in the checkpoint's record)


def read_checked_config(path: str, world_size: int | None, pp: int | None, sp: int | None = None) -> tuple[dict, int]:
    """The DeepSpeed dict and pp, through the same loader, schema and rules as `dstk validate`
    (strict: "auto" is for the HF Trainer, which is not running here); every error raised at once.
    world_size None: the rules that need it are skipped (checked again once the group is up).
    sp (--sp): the config's sequence_parallel_size replaced, as --pp replaces its pipeline.stages."""
    from toolkit.config.loader import load_config
    from toolkit.config.problems import raise_errors

    cfg, problems = load_config(path, world_size=world_size, pp=pp, strict=True, sp=sp)
    if sp is not None:
        cfg = {k: v for k, v in cfg.items() if k != "sequence_parallel_size"}
        cfg.update({"sequence_parallel_size": sp} if sp > 1 else {})
    flags = "".join(f" --{k} {v}" for k, v in (("world-size", world_size), ("pp", pp), ("sp", sp)) if v is not None)
    raise_errors(problems, path, "is refused for training" + (f" on {world_size} process(es)" if world_size else "")
                 + (f" with --sp {sp}" if sp is not None else ""), flags)
    stages = pp or cfg.get("pipeline", {}).get("stages") or 1
    return cfg, stages


def check_attention_precision(attention: str, cfg: dict) -> None:
    """flash-attn computes in fp16/bf16 only: under an fp32 config the first forward fails on every rank."""
    if attention == "flash_attention_2" and not any((cfg.get(key) or {}).get("enabled") is True
                                                   for key in ("bf16", "bfloat16", "fp16")):
        raise ConfigError('--attention flash_attention_2 with an fp32 config: flash-attn computes in fp16/bf16 only, '
                          'so the first forward would fail; add "bf16": {"enabled": true} to the config, or use '
                          "--attention sdpa")


def check_shared_out(out) -> None:
    """Every rank writes its part of each checkpoint into --out and rank 0 reads them all (resume, export):
    refuse an --out that is each node's own disk, before anything is built."""
    views = process_group.shared_with_rank0(out)
    blind = [rank for rank, (_, seen) in enumerate(views) if not seen]
    if blind:
        hosts = ", ".join(sorted({views[r][0] for r in blind}))
        raise ConfigError(f"--out {out} is not one folder for every node: rank 0 ({views[0][0]}) wrote a file there "
                          f"that rank(s) {blind} on {hosts} do not see after {process_group.SHARED_WAIT:.0f} s; every "
                          "rank writes its part of each checkpoint there and rank 0 reads them all (resume, export): "
                          "put --out on a file system every node mounts (NFS, Lustre, ...)")


def local_inputs(args: TrainArgs, fetch: bool = False) -> TrainArgs | None:
    """`args` with each hub id of --model and --tokenizer replaced by its snapshot folder at --revision in
    huggingface_hub's cache (models.weights.hub), the ids kept in hub_ids; unchanged without one. fetch (on the
    ranks, once the process group is up): online, one rank per node downloads what the cache lacks while the
    others wait, however long; offline, from the cache alone. Without fetch (check, before any rank starts):
    from the cache alone, never the network; None when online and an id is not cached yet (the ranks download
    it); offline, such an id is refused at once."""
    from dataclasses import replace

    from models.weights import hub

    ids = {flag: name for flag, name in (("--model", args.model), ("--tokenizer", args.tokenizer))
           if name and hub.is_hub_id(name)}
    if not ids:
        return args
    if fetch:
        def folders_of(download):
            return {flag: hub.snapshot(name, args.revision, flag, download=download) for flag, name in ids.items()}

        what = f"downloading {', '.join(ids.values())}"
        folders, fetched = process_group.once_per_node(lambda: folders_of(True), what)
        folders = folders if fetched else folders_of(False)  # the others: what the fetching rank put in the cache
    else:
        folders = {flag: hub.cached(name, args.revision) for flag, name in ids.items()}
        if None in folders.values() and not hub.offline():
            return None
        folders = {flag: folder or hub.snapshot(ids[flag], args.revision, flag, download=False)
                   for flag, folder in folders.items()}
    return replace(args, model=folders.get("--model", args.model), tokenizer=folders.get("--tokenizer", args.tokenizer),
                   hub_ids=ids)


def check_model(args: TrainArgs, cfg: dict, world_size: int | None) -> None:
    """The model's refusals, on local inputs (local_inputs): its name or folder (config.json, safetensors
    headers), the tokenizer's folder, any recorded pipeline.parts, and --qlora where the ranks run."""
    from toolkit.distributed.pipeline import check_recorded_parts
    from toolkit.train import hf

    hf.check_model_name(args.model)
    hf.check_tokenizer(args.model, args.tokenizer)
    check_recorded_parts(cfg, args.config, args.model, args.task)
    _check_dualpipev_layers(args, cfg)
    _check_fits_model(args, cfg)
    _check_router_aux(args, cfg)
    _check_experts(args, cfg)
    if world_size is not None and args.qlora:  # known: the ranks run here (launch.sh on a login node passes none)
        from toolkit.train.lora import check_qlora_here

        check_qlora_here(args.model)


def _check_fits_model(args: TrainArgs, cfg: dict) -> None:
    """What the ranks would refuse after the launch, from config.json and the folder's file names alone:
    --seq-len beyond the model's positions (the data preparation's own rule), and pipeline stages (pp > 1)
    over a folder without safetensors (each stage reads its own layers from them), and tp > 1 over a model
    AutoTP cannot shard."""
    from toolkit.data.source import seq_len_fits
    from toolkit.train import hf

    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        return  # a built-in name: its positions are the arch's, and dstk builds it
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # check_model_name has said why already
    seq_len_fits(args.seq_len, next((config[k] for k in ("max_position_embeddings", "n_positions")
                                     if isinstance(config.get(k), int)), None))
    tp = tp_of(cfg)
    if tp > 1:  # the ranks' own rule (toolkit.train.hf.check_tensor_parallel), on the folder's HF config
        from transformers import AutoConfig

        section = cfg.get("tensor_parallel") or {}
        hf.check_tensor_parallel(AutoConfig.from_pretrained(folder), tp,
                                 custom_plan=bool(section.get("preset_model") or section.get("partition_config")))
    pp = args.pp or (cfg.get("pipeline") or {}).get("stages") or 1
    safetensors = ("model.safetensors", "model.safetensors.index.json")
    if isinstance(pp, int) and pp > 1 and not any((folder / name).is_file() for name in safetensors):
        raise UnusableInput(f"--model {args.model} holds no safetensors (pytorch_model.bin only?): pipeline stages "
                            f"(pp {pp}) each read their own layers from model.safetensors. Convert the folder once: "
                            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR), then --model NEW_DIR")


def _check_experts(args: TrainArgs, cfg: dict) -> None:
    """"expert_parallel" against the model (`dstk validate --model`'s check, from config.json alone): a model with
    experts, ep dividing them. Otherwise AutoEP raises on every rank after the launch."""
    from toolkit.config.problems import ERROR
    from toolkit.config.rules.expert_parallel import model_problems
    from toolkit.plan.arch import load_arch

    if (cfg.get("expert_parallel") or {}).get("enabled") is not True:
        return
    try:
        arch = load_arch(args.model)
    except ConfigError:  # a structure the planner does not read: AutoEP's own check on the ranks
        return
    errors = [p.message for p in model_problems(cfg, arch) if p.severity == ERROR]
    if errors:
        raise ConfigError("; ".join(errors))


def _check_dualpipev_layers(args: TrainArgs, cfg: dict) -> None:
    """--schedule dualpipev: 2 pp stages need 2 pp pipeline layers (counted from config.json alone)."""
    from toolkit.distributed.dualpipev import check_layers
    from toolkit.plan.arch import load_arch

    pp = args.pp or (cfg.get("pipeline") or {}).get("stages") or 1
    if args.schedule != "dualpipev" or not isinstance(pp, int) or pp < 2:
        return
    try:
        layers = load_arch(args.model).num_pipeline_layers
    except ConfigError:  # a structure the planner does not read: the build checks the stages itself
        return
    check_layers(args.schedule, pp, args.model, layers)


def _check_router_aux(args: TrainArgs, cfg: dict) -> None:
    """pp > 1 from a directory whose config.json turns output_router_logits on: the MoE router aux loss that the
    stages carry (models.moe), or the refusal a stage would raise, with its reason and fix. Only then does --check
    import transformers (the model class decides)."""
    pp = args.pp or (cfg.get("pipeline") or {}).get("stages") or 1
    if isinstance(pp, int) and pp > 1 and Path(args.model).is_dir() and _router_logits_on(Path(args.model)):
        from models.api import check_router_aux

        check_router_aux(args.model, args.task)


def _router_logits_on(folder: Path) -> bool:
    """Whether folder/config.json turns output_router_logits on, in itself or a sub-config (its text config)."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the model checks say what is wrong with the folder
    subs = [v for v in config.values() if isinstance(v, dict)]
    return any(c.get("output_router_logits") is True for c in [config, *subs])


def check_sequence_parallel(args: TrainArgs, cfg: dict, pp: int = 1) -> None:
    """sp > 1 ("sequence_parallel_size"): the attention, the model's heads and --seq-len as Ulysses needs them;
    inside pipeline stages (pp > 1) a model whose stage layers run on a slice of the sequence."""
    from toolkit.config.rules.sequence_parallel import ulysses_problems
    from toolkit.distributed.sequence_parallel import check_attention
    from toolkit.plan.arch import load_arch

    sp = sp_of(cfg)
    if sp == 1:
        return
    if args.task != "causal-lm":
        raise ConfigError(f'"sequence_parallel_size" {sp} with --task {args.task}: Ulysses splits a causal LM\'s '
                          'sequence; use "sequence_parallel_size": 1')
    mbs = cfg.get("train_micro_batch_size_per_gpu")
    check_attention(args.attention, sp, mbs if isinstance(mbs, int) else 1)
    arch = load_arch(args.model)
    problems = ulysses_problems(arch.heads, arch.kv_heads, sp, args.seq_len)
    if arch.experts and arch.extra.get("output_router_logits"):
        problems.append(f"output_router_logits is true in {args.model}'s config: the MoE router aux loss is a product "
                        "of per-expert token shares, which each sp rank would compute over its slice alone (not one "
                        "process's loss); set output_router_logits false, or use sp 1")
    if pp > 1 and arch.learned_positions:
        problems.append(f"model_type {arch.model_type} adds learned positions in its pipeline embedding layer, which "
                        f"does not run on a slice of the sequence yet; use pp 1 with sp {sp}, or sp 1")
    if problems:
        raise ConfigError(f"{args.model}: " + "; ".join(problems))


def check_offload(mode: str, cfg: dict, pp) -> None:
    """--offload-activations on needs checkpoints to move: at pp 1 the config's activation_checkpointing section,
    in a pipeline pipeline.activation_checkpoint_interval (models.tiled.offload.choose's refusal, before any rank)."""
    from models.tiled.offload import choose

    interval = (cfg.get("pipeline") or {}).get("activation_checkpoint_interval") or 0
    checkpointing = interval > 0 if isinstance(pp, int) and pp > 1 else "activation_checkpointing" in cfg
    if mode == "on":
        choose(mode, 0, checkpointing, "cuda")


def check_expert_parallel(args: TrainArgs, cfg: dict, pp) -> None:
    """"expert_parallel" (DeepSpeed's AutoEP): what dstk train does not combine with it yet, every reason at once."""
    from toolkit.config.rules.expert_parallel import train_refusals

    refusals = train_refusals(cfg, pp if isinstance(pp, int) else 1, args.schedule, args.lora or args.qlora)
    if refusals:
        raise ConfigError("; ".join(refusals))


def check(args: TrainArgs, world_size: int | None) -> None:
    """The refusals that need no process group: the config (for `world_size` processes when known), the
    model and tokenizer folders (a hub id's from the cache alone: one not cached yet is the ranks' to
    download, online, and refused here offline), the data file, the run folder. Every rank runs them
    first, so a mistake costs seconds, not a rendezvous; launch.sh runs them once before it starts any
    rank (`--check`)."""
    from toolkit.data.source import check_path
    from toolkit.checkpoint import run_folder
    from toolkit.distributed import dualpipev
    from toolkit.train import hf, lora, preference

    from toolkit.train.report.trackers import check_deepspeed_monitors, check_report_to, check_tracker_folders

    cfg, pp = read_checked_config(args.config, world_size, args.pp, args.sp)
    check_tracker_folders(check_report_to(args.report_to), run_folder.RunFolder(args.out))
    check_deepspeed_monitors(cfg, args.config)
    check_attention_precision(args.attention, cfg)
    lora.check(lora.settings_of(args), pp, (cfg.get("zero_optimization") or {}).get("stage", 0), tp_of(cfg))
    dualpipev.check(args.schedule, cfg, pp, world_size)
    check_offload(args.offload_activations, cfg, pp)
    check_expert_parallel(args, cfg, pp)
    preference.check(args, cfg, pp, sp_of(cfg), tp_of(cfg))
    local = local_inputs(args)
    if local is not None:
        check_model(local, cfg, world_size)
        check_sequence_parallel(local, cfg, pp)
    if world_size is not None:
        hf.check_attention(args.attention)
    check_path(args.data, encoding=args.encoding)
    if args.streaming:
        from types import SimpleNamespace

        from toolkit.data.stream import check_rows_for_dp, check_streamable

        check_streamable(args.data, args.eval_fraction, args.eval_data, args.steps, args.task)
        if world_size is not None:  # a document for every dp rank (the first dp documents read, no more); what
            # open_stream reads of the data options (job.data_options would import torch: --check starts fast)
            opts = SimpleNamespace(path=args.data, encoding=args.encoding, task=args.task, format=args.format,
                                   text_field=args.text_field)
            check_rows_for_dp(opts, world_size // (pp * tp_of(cfg) * sp_of(cfg)))
    if args.eval_data:
        check_path(args.eval_data, "--eval-data", args.encoding)
    if args.chat_template:
        hf.read_chat_template(args.chat_template)
    if local is not None and preference.uses_preference(args):  # every pair's refusals, before any rank starts
        from toolkit.data.pairs.check import check_rows

        if Path(local.model).is_dir() and _router_logits_on(Path(local.model)):
            raise ConfigError(f"--objective dpo: {local.model}'s config.json turns output_router_logits on, and the "
                              "router aux loss is not added to the DPO loss yet; set output_router_logits false there")

        tok = hf.load_tokenizer(local.model, local.tokenizer, args.chat_template)
        for path, flag in ((args.data, "--data"), (args.eval_data, "--eval-data")):
            if path and not args.streaming:
                check_rows(path, tok, args.seq_len, args.encoding, args.data_cache, args.format, flag)
    run_folder.check_out(args.out, args.resume, args.overwrite, out_inputs(local or args))
    if args.resume_with_new_data and not args.resume:
        raise ConfigError("--resume-with-new-data continues a run: pass it with --resume")
    if args.resume and local is not None:  # the run's own token stream and model, before any rank starts
        from toolkit.checkpoint import manifest
        from toolkit.train.job import run_identity

        from toolkit.checkpoint import safe_load

        folder = run_folder.RunFolder(args.out)
        latest = manifest.read_latest(folder.checkpoints)
        topo = None if world_size is None else Topology(world_size, pp, tp_of(cfg), sp_of(cfg))
        manifest.check_resumable(folder.checkpoints, run_identity(local, topo, cfg), latest,  # a move it cannot
                                 new_data=args.resume_with_new_data, layout=topo is not None)  # make: with the world
        safe_load.trust(args.trust_checkpoint)
        if latest is not None:
            safe_load.check_tag(folder.checkpoints / latest)


def out_inputs(args: TrainArgs) -> dict:
    """What the run reads, by flag: --overwrite never deletes a folder holding one of them."""
    return {"--model": args.model, "--data": args.data, "--eval-data": args.eval_data, "--config": args.config,
            "--tokenizer": args.tokenizer, "--chat-template": args.chat_template}


def _log_levels(verbose: bool) -> None:
    """DeepSpeed at INFO only with --verbose; no transformers progress bars (export) without it, and no
    progress bar at all (datasets' included) when stderr is not a terminal. torch's
    FutureWarning that all_gather_into_tensor is deprecated comes from DeepSpeed's own calls (the pipeline
    engine gathers tp-partitioned activations at every micro-batch): nothing a user can act on."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)

    from deepspeed.utils import logger
    from transformers.utils import logging as hf_logging

    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
        hf_logging.disable_progress_bar()
    if not sys.stderr.isatty():  # a log file: no progress bar (its carriage returns pile up as one long line)
        import datasets

        datasets.disable_progress_bars()
        hf_logging.disable_progress_bar()


def run(args: TrainArgs, teardown: bool = False, recipe: str | None = None) -> dict:
    """Train, checkpoint and export (run_locked) holding --out's lock: rank 0 takes it once the process group is up,
    before anything is written there, and releases it however the run ends (toolkit.checkpoint.lock)."""
    from toolkit.checkpoint.lock import RunLock
    from toolkit.distributed.resilience import SignalStop

    signals = SignalStop() if args.save_on_signal else None  # before the lock: it then leaves SIGTERM to this
    try:
        with RunLock(args.out, "dstk train") as out_lock:
            return run_locked(args, out_lock, teardown, recipe, signals)
    finally:
        if signals is not None:
            signals.restore()


def run_locked(args: TrainArgs, out_lock, teardown: bool = False, recipe: str | None = None, signals=None) -> dict:
    """Train, checkpoint and export; returns the summary (the same dict on every rank).

    recipe: the flags of this run as a YAML recipe (toolkit.config.recipe.recorded), which rank 0 saves as
    OUT/recipe.yaml once the run is built (a refusal before that leaves --out as it was).

    teardown (the process entry, `dstk train`): the process group is destroyed once training is over,
    before rank 0 draws the loss curve and exports; nobody waits in a collective (whose timeout
    would abort the ranks) while a large model is converted. In-process callers keep their group.
    The export runs after the engine is gone and streams a full model (about one layer in memory)."""
    from toolkit.checkpoint import run_folder
    from toolkit.distributed import resilience
    from toolkit.distributed.agreement import agree
    from toolkit.train import lora
    from toolkit.train import loop as train_loop
    from toolkit.train.engine import rank_device
    from toolkit.export.directory import export
    from toolkit.train.report import StartClock

    clock = StartClock()
    world = process_group.env_world_size()
    check(args, world)
    clock.mark("checks")
    _log_levels(args.verbose)
    dist = process_group.init()
    resilience.know_peers(rank_device())
    clock.mark("process group")
    folder = run_folder.RunFolder(args.out)
    ckpt_dir = folder.checkpoints
    try:
        args, job = set_up(args, world, clock, out_lock)
        with agree("writing --out's recipe.yaml", name_ranks=False):
            if recipe is not None and dist.get_rank() == 0:
                from toolkit.files import write_text

                write_text(recipe, str(folder.recipe), force=True, flag="--out's")
    except Exception as exc:
        if teardown and getattr(exc, "agreed", False):  # every rank raises it (an agreement): none is left to die at
            process_group.shutdown()  # exit in gloo's threads (exit -6); they meet in its barrier
        raise
    watchdog = None
    if args.step_timeout:
        from toolkit.checkpoint.lock import release

        watchdog = resilience.Watchdog(args.step_timeout, dist.get_rank(), lambda: release(args.out, out_lock.held))
    try:
        summary = train_loop.run_steps(args, job, dist.get_rank() == 0, watchdog, signals)
    finally:
        if watchdog is not None:
            watchdog.close()
    summary["rank0"] = dist.get_rank() == 0
    dist.barrier()  # every rank's last checkpoint is complete
    job.engine.destroy()  # autograd hooks keep an engine (and its buffers) alive otherwise
    del job  # the engine, module, optimizer states and data: nothing of training stays resident for the export
    import gc

    gc.collect()
    if teardown:
        process_group.shutdown()
    if summary["rank0"]:
        summary.update(_loss_png(folder))  # loss_png: the path, or None and loss_png_skipped: why
        summary["summary_json"] = str(folder.summary)
        if args.export and not summary.get("stopped_by"):
            adapters = folder.adapter if lora.settings_of(args) else None
            summary["export"] = str(export(ckpt_dir, folder.hf, adapter_dir=adapters))
        write_summary(folder.summary, {k: v for k, v in summary.items() if k != "rank0"})
    return summary


def set_up(args: TrainArgs, world: int | None, clock, out_lock) -> tuple:
    """(args with local inputs, job.Job) once the process group is up: --out's lock taken by rank 0 (out_lock, a
    toolkit.checkpoint.lock.RunLock) and what --out holds judged under it, the checks that need the group, --out
    cleared for --overwrite, then the data, model and engine. Where ranks may part ways (each reads its own files),
    they agree (toolkit.distributed.agreement): an error only some reach is every rank's, one line."""
    import torch.distributed as dist

    from toolkit.checkpoint import manifest, run_folder, safe_load
    from toolkit.distributed.agreement import agree
    from toolkit.train import job as train_job
    from toolkit.train import lora

    with agree("checking the config, --out and the model"):
        # first in the phase, so every rank reaches its broadcast; its refusal is every rank's already
        out_lock.take_on_rank0(lambda: run_folder.check_held(args.out, args.resume, args.overwrite, out_inputs(args)))
        if out_lock.note:
            print(f"note: {out_lock.note}", file=sys.stderr, flush=True)
        cfg, pp = read_checked_config(args.config, dist.get_world_size(), args.pp, args.sp)
        check_shared_out(args.out)  # its collectives agree on their own; so do local_inputs' downloads
        local = local_inputs(args, fetch=True)  # hub ids -> folders in the cache, downloaded once per node
        if local is not args:
            check_model(local, cfg, world)  # check() could not read a folder that was not downloaded yet
        if local.qlora and world is None:  # check() looks where the ranks run only when a launcher says so
            lora.check_qlora_here(local.model)
    args = local
    topo = Topology(dist.get_world_size(), pp, tp_of(cfg), sp_of(cfg))
    _, dp_rank = topo.coords(dist.get_rank())
    ckpt_dir = run_folder.RunFolder(args.out).checkpoints
    resume_tag = manifest.agreed_latest(ckpt_dir) if args.resume else None
    # nobody writes into --out before it is cleared, however long it takes (--resume and --overwrite exclude each other)
    with agree("checking the checkpoint to resume" if resume_tag else "clearing --out", name_ranks=bool(resume_tag)):
        if resume_tag:
            manifest.check_resumable(ckpt_dir, train_job.run_identity(args, topo, cfg), resume_tag,
                                     new_data=args.resume_with_new_data)
            safe_load.trust(args.trust_checkpoint)
            safe_load.check_tag(ckpt_dir / resume_tag)  # before DeepSpeed or dstk loads any of it
        if args.overwrite and dist.get_rank() == 0:
            run_folder.clear(args.out)
    return args, train_job.prepare(args, cfg, topo, dp_rank, resume_tag, clock)


def write_summary(path: Path, summary: dict) -> None:
    """OUT/summary.json, whole (per-rank lists included), replaced atomically."""
    import json

    from toolkit.files import write_text

    write_text(json.dumps(summary, indent=1) + "\n", str(path), force=True, flag="--out's")


def _loss_png(folder) -> dict:
    from toolkit.train.report import draw_loss_png, read_metrics

    return draw_loss_png(*read_metrics(folder.metrics), folder.loss_png)
