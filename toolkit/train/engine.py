"""The model and its DeepSpeed engine on this rank: its device and precision, the model built (make_model), its
parameter groups and the config deepspeed.initialize gets, the engine started, and DeepSpeed's own load of a
checkpoint, around its bf16/fp16 optimizer wrappers; HF's padding-mask advice silenced for packed rows.

Which wrapper DeepSpeed picks, and what dstk does about each, is toolkit.distributed.optimizers' (read by the
checkpoints too): `initialize` settles an FP16 wrapper right after it is built, and `load` has DeepSpeed read a
BF16_Optimizer's per-rank files itself at ZeRO-0 (the engine hands it the model states' single dict).
"""

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from models.weights import loading
from toolkit.distributed.optimizers import is_bf16_optimizer, settle
from toolkit.distributed.topology import config_batch, ep_of
from toolkit.errors import ConfigError


def dtype_of(cfg: dict) -> str:
    """The run's precision as the opening block names it: bf16, fp16 or fp32 (loading.param_dtype: as DeepSpeed
    reads the config, its old "bfloat16" key included)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(loading.param_dtype(cfg), "fp32")


def rank_device():
    """The device this rank's engine will use: the GPU process_group.init selected, else the CPU."""
    from toolkit.distributed.process_group import engine_args

    chosen = engine_args()
    return torch.device("cpu") if chosen is None else torch.device("cuda", chosen.device_rank)


def make_model(args, config, topo, cfg: dict, objective=None):
    """(model for deepspeed.initialize, its part of the manifest). pp > 1 with a local directory: no rank builds the
    whole model; each stage reads its own layers' tensors (toolkit.distributed.pipeline). objective: --objective
    dpo's DpoLoss (a pipeline's loss_fn), with dropout off (TRL's default) and the head untiled."""
    from models.lora import adapters
    from models.tiled.offload import decide
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
        tiled = tile_loss(args, model, config, topo, cfg)
        mlp = tile_mlp(args, model, config, topo, cfg)  # the MLP modules' forwards: peft's adapters go inside them
        tokens = config_batch(cfg, topo.dp).mbs * args.seq_len // topo.sp
        offload = decide(args.offload_activations, config, tokens, 1, loading.param_dtype(cfg).itemsize, checkpointing,
                         rank_device().type)  # models.tiled.offload: around_micro_batch acts on it
        record = {"pp": 1}
        if settings is not None:
            record["lora"] = adapters.manifest_entry(settings, model, args.task)
            model = adapters.apply(model, settings, args.task, args.seed)
        model.dstk_tiled_loss, model.dstk_tiled_mlp, model.dstk_offload_activations = tiled, mlp, offload
        if objective is not None:
            from models.objectives import disable_dropout

            disable_dropout(model)
        model.train()  # from_pretrained returns it in eval mode: no dropout, and HF checkpoints only in training mode
        return model, record
    from toolkit.distributed.pipeline import pipeline_module

    if Path(args.model).is_dir():
        torch.manual_seed(args.seed)  # heads the directory lacks: the same init on every dp replica
        source = args.model
    else:  # built-in: tiny, random from the seed, identical on every rank and layout
        source = loading.build_model(args.model, config, args.task, args.seed)  # tiny: no ZeRO-3 at pp > 1
        if settings is not None:
            source = adapters.apply(source, settings, args.task, args.seed).base_model.model  # the HF model inside
    return pipeline_module(source, args.task, topo, cfg, seq_len=args.seq_len, config=config, verbose=args.verbose,
                           lora=settings, seed=args.seed, schedule=args.schedule, tiled_loss=args.tiled_loss,
                           tiled_mlp=args.tiled_mlp, offload_activations=args.offload_activations, objective=objective)


def tile_loss(args, model, config, topo, cfg: dict) -> tuple:
    """--tiled-loss at pp 1 (models.tiled.loss.choose): the HF model's forward made to compute its loss tiled where
    its head is one dstk reproduces (models.generic.generic_head); (on, why) for the opening block."""
    from models.generic import LogitTransform, generic_head
    from models.tiled.loss import choose, patch_causal_lm
    from toolkit.distributed.topology import config_batch

    blocker = f"--task {args.task}: only the causal LM loss is tiled" if args.task != "causal-lm" else None
    if getattr(args, "objective", "lm") != "lm":
        blocker = f"--objective {args.objective} scores each row from the whole logits"
    blocker = blocker or generic_head(model, config)
    tokens = config_batch(cfg, topo.dp).mbs * args.seq_len // topo.sp
    on, why = choose(args.tiled_loss, tokens, config.get_text_config().vocab_size, blocker)
    if on:
        patch_causal_lm(model, LogitTransform(config))
    return on, why


def tile_mlp(args, model, config, topo, cfg: dict) -> tuple:
    """--tiled-mlp at pp 1 (models.tiled.mlp.decide): each block's dense MLP through TiledMLP; (on, why, shards)
    for the opening block."""
    from models.tiled.mlp import decide, layout_blocker, patch_mlps, widths

    blocker = layout_blocker(topo.tp)
    tokens = config_batch(cfg, topo.dp).mbs * args.seq_len // topo.sp
    itemsize = loading.param_dtype(cfg).itemsize
    on, why, shards = decide(args.tiled_mlp, model, config, tokens, itemsize, blocker, args.seq_len // topo.sp)
    if on:
        patch_mlps(model, widths(config)[0])
    return on, why, shards


def model_of_rank(args, config, topo, cfg: dict, objective=None):
    """make_model, with a refusal that names this rank: each stage reads its own tensors, so this rank
    may be the only one failing."""
    try:
        return make_model(args, config, topo, cfg, objective)
    except ConfigError as exc:
        stage = topo.coords(dist.get_rank())[0]
        failed = type(exc)(f"rank {dist.get_rank()} (pipeline stage {stage}): {exc}")
        failed.every_rank = True  # printed by the rank that hit it, not only by rank 0
        raise failed from None


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
    if topo.pp > 1:  # "expert_parallel": dstk replaced the stages' MoE blocks (toolkit.distributed.tensor_parallel)
        cfg = {k: v for k, v in cfg.items() if k != "expert_parallel"} | {"steps_per_print": NEVER_PRINT}
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
    if (cfg.get("expert_parallel") or {}).get("enabled") is True:  # AutoEP replaces the MoE blocks in initialize
        from models.autoep import allow_string_keys

        allow_string_keys()
        record["expert_parallel"] = ep_of(cfg)
        for group, name in zip(groups, ("decay", "no_decay")):  # DeepSpeed splits named groups into expert and dense
            group["name"] = name  # ones (moe/utils.py:103 reads param_group["name"])
    engine = initialize(model, groups, deepspeed_config(cfg, topo), verbose=verbose, mpu=mpu)
    named = optimizer_param_names(engine) if "expert_parallel" in record else None  # AutoEP replaced the experts'
    if named:  # parameters (pp 1) and DeepSpeed split each group into dense and expert ones: the optimizer's order
        param_names = named
        if topo.pp == 1:
            record["param_groups"] = named
    return engine, param_names


def optimizer_param_names(engine) -> list | None:
    """The engine's optimizer parameters by module name, per group, in its order after initialize (under AutoEP:
    the AutoEP layers' own parameters, each named group split into its dense and expert groups): how torch's state
    at ZeRO-0 is named. None where the optimizer holds other tensors than the module's (ZeRO's flat partitions)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [[names.get(id(p)) for p in group["params"]] for group in engine.optimizer.param_groups]
    return None if any(name is None for group in groups for name in group) else groups


def initialize(model, groups: list, config: dict, verbose: bool = False, mpu=None):
    """deepspeed.initialize on the GPU toolkit.distributed.process_group chose, settled; its prints (BF16_Optimizer reports memory
    on stdout, forced, while it builds) only with --verbose. mpu: Ulysses' groups (sp > 1), else None."""
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


class _NoPaddingMaskWarning:
    """Packed rows pass attention_mask=None on purpose (positions carry the documents): HF's advice to
    pass a padding mask then does not apply."""

    @staticmethod
    def filter(record) -> bool:
        return "strongly recommend passing in an `attention_mask`" not in record.getMessage()


def quiet_packed_rows() -> None:
    import logging

    logging.getLogger("transformers.modeling_utils").addFilter(_NoPaddingMaskWarning)
