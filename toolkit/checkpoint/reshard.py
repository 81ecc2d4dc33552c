"""`dstk reshard CKPT OUT --pp N [--dp M --sp S --zero Z]`: a checkpoint made ready for another layout, offline.

OUT becomes a run folder whose checkpoints/ holds the tag's whole training state by HF name
(toolkit.checkpoint.portable: fp32 weights, Adam moments, optimizer step, LR scheduler, step counters) and
the run's dstk/ folder with the target layout in its manifest; `dstk train --out OUT --resume` on that
layout reads from it only the tensors its rank holds. (`--resume` straight from the original checkpoint on
another layout also works: then every rank reads the DeepSpeed files itself.) OUT is written whole or not at all,
under its lock (toolkit.checkpoint.lock: a run folder is written by one process at a time).
"""

import shutil
import tempfile
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.files import check_writable
from toolkit.checkpoint import portable
from toolkit.checkpoint.lock import RunLock, is_lock_file
from toolkit.checkpoint.run_folder import RunFolder, check_not_in_use
from toolkit.checkpoint.manifest import DATA_POSITION, EP, META, check_resumable, layout_of, read_manifest, write_latest, write_manifest
from toolkit.checkpoint.state import find_checkpoint_dir, resolve_tag
from toolkit.checkpoint.safe_load import check_tag


def reshard_checkpoint(ckpt, out, tag=None, pp=None, dp=None, zero=None, sp=None, schedule=None, ep=None) -> dict:
    """Write OUT (a run folder) from checkpoint `tag` of CKPT for layout pp x dp x sp x ZeRO (None: unchanged);
    ep 1 takes an expert-parallel (AutoEP) run onto a layout without AutoEP, every expert on every rank;
    returns what was done (the --json summary). No parameter depends on sp (Ulysses splits the sequence, not the
    weights): an sp move is a move of the ZeRO partitions (over a stage's dp x sp ranks) and of dp."""
    ckpt_dir = find_checkpoint_dir(ckpt)
    tag = resolve_tag(ckpt_dir, tag)
    check_tag(ckpt_dir / tag)  # a class outside DeepSpeed's in any of its files: refused before anything is read
    out = Path(out)
    check_writable(out, "OUT_DIR", beside=True)  # a file above it, a link to nowhere, a place this process cannot write
    check_not_in_use(out, "OUT_DIR")  # a run writing there now
    _check_empty(out)
    manifest = read_manifest(ckpt_dir)
    if manifest.get("tp", 1) > 1:
        raise ConfigError(f"{ckpt_dir} is a tensor-parallel run (tp {manifest['tp']}): its tensors are tp shards, "
                          "which only `dstk export` merges today; export it and start a new run from the HF directory")
    source = layout_of(manifest)
    target = {**source, **{k: v for k, v in (("pp", pp), ("dp", dp), ("sp", sp), ("zero_stage", zero),
                                             ("schedule", schedule)) if v is not None}}
    if schedule is None and target["pp"] == 1 and target.get("schedule") == "dualpipev":
        target["schedule"] = "1f1b"  # one stage has no pipeline schedule: moving onto pp 1 drops DualPipeV
    _check_target(ckpt_dir, manifest, target, _pipeline_layers(ckpt_dir, manifest))
    now = {**manifest, **target}
    if ep is not None:
        target = {**target, **_expert_parallel(manifest, ep)}
        if target[EP] and target["pp"] > 1:
            raise ConfigError(f"--ep {ep} with --pp {target['pp']}: dstk trains AutoEP at pp 1 only; use --pp 1")
        _check_experts(manifest, target)
        now = {k: v for k, v in {**now, **target}.items() if k != EP or v}
    positions = sorted((ckpt_dir / tag).glob(DATA_POSITION.format("*")))  # a --streaming run's places in its stream
    if positions and target["dp"] != source["dp"]:
        raise ConfigError(f"--dp {target['dp']}: {ckpt_dir} is a --streaming run, whose place in its stream is kept "
                          f"per data-parallel replica (rows i % dp); it moves to another pp, sp or ZeRO stage but "
                          f"keeps dp {source['dp']}")
    check_resumable(ckpt_dir, now)  # older checkpoints, and moves it cannot make: refused here too
    state = portable.read(ckpt_dir, tag)
    recipe_text = _recipe(ckpt_dir.parent / "recipe.yaml", out, source, target)  # read before anything is written
    recipe = out / "recipe.yaml" if recipe_text is not None else None
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {out}: directory {parent} does not exist; create it first")
    made = not out.exists()
    try:
        with RunLock(out, "dstk reshard", "OUT_DIR") as held:  # OUT made and locked: no run starts there meanwhile
            held.take()
            _check_empty(out)
            size = _write(out, ckpt_dir, tag, {**now, "portable": True}, state, positions)
            if recipe is not None:
                recipe.write_text(recipe_text)
    except BaseException:
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # written whole or not at all
        raise
    resume = (f"dstk train --recipe {recipe} --resume" if recipe is not None else
              f"dstk train ... --out {out} --resume (with a config for pp {target['pp']}, dp {target['dp']}, "
              f"ZeRO {target['zero_stage']}" + (f', "sequence_parallel_size": {target["sp"]}' if target["sp"] > 1
                                                else "") + ")"
              + (" --schedule dualpipev" if target["schedule"] == "dualpipev" else ""))
    return {"checkpoint": str(ckpt_dir), "tag": tag, "out": str(out), "from": source, "to": target,
            "tensors": len(state.weights), "bytes": size, "optimizer_step": state.optimizer_step,
            "recipe": None if recipe is None else str(recipe), "resume": resume}


def _recipe(source_recipe: Path, out: Path, was: dict, now: dict):
    """The text of OUT/recipe.yaml: the source run's flags with --out OUT and its inline DeepSpeed config made for the
    target layout (pipeline stages, ZeRO stage, sequence_parallel_size, gas for the new dp at the same
    global batch; a partition recorded for another pp dropped), so `--recipe OUT/recipe.yaml --resume`
    continues the run there. None (no recipe) when the source run has none or its batch cannot be kept on
    the new dp (gbs not divisible by mbs x dp)."""
    import yaml

    from toolkit.config.recipe import read_mapping

    if not source_recipe.is_file():
        return None
    flags = read_mapping(str(source_recipe))
    cfg = flags.get("config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("train_micro_batch_size_per_gpu"), int):
        return None
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_accumulation_steps", 1)
    gbs = mbs * gas * was["dp"]
    if gbs % (mbs * now["dp"]):
        return None
    cfg = {**cfg, "gradient_accumulation_steps": gbs // (mbs * now["dp"])}
    if "train_batch_size" in cfg:
        cfg["train_batch_size"] = gbs
    pipeline = {k: v for k, v in (cfg.get("pipeline") or {}).items() if now["pp"] == was["pp"] or k != "parts"}
    cfg["pipeline"] = {**pipeline, "stages": now["pp"]}
    cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": now["zero_stage"]}
    cfg.pop("sequence_parallel_size", None)
    cfg.update({"sequence_parallel_size": now["sp"]} if now["sp"] > 1 else {})
    if not now.get(EP):  # moved off AutoEP: every rank holds every expert
        cfg.pop("expert_parallel", None)
    else:
        cfg["expert_parallel"] = {**(cfg.get("expert_parallel") or {}), "enabled": True, "autoep_size": now[EP]}
    flags = {k: v for k, v in flags.items() if k not in ("pp", "schedule", "config", "resume")}
    flags.update({"out": str(out), **({"schedule": "dualpipev"} if now.get("schedule") == "dualpipev" else {}),
                  "config": cfg})
    return (f"# The flags of the run resharded from {source_recipe.parent} (dstk reshard), for its new layout.\n"
            f"# Continue it: --recipe {out / 'recipe.yaml'} --resume (--steps N for more)\n"
            + yaml.safe_dump(flags, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100))


def _check_experts(manifest: dict, target: dict) -> None:
    """The target's ep against its data-parallel ranks and the model's experts (the run's --model, read from its
    config.json or a built-in's dimensions where it can be): what `dstk train --check` would refuse after the write."""
    from toolkit.config.problems import ERROR
    from toolkit.config.rules.expert_parallel import divisors, expert_parallel_section, model_problems
    from toolkit.plan.arch import load_arch

    ep, ranks = target[EP], target["dp"] * target.get("sp", 1)
    if not ep:
        return
    if ranks % ep:
        raise ConfigError(f"--ep {ep} does not divide the {ranks} data-parallel ranks of --dp {target['dp']}: AutoEP "
                          f"groups ep consecutive ranks; use --ep one of {divisors(ranks)}")
    try:
        arch = load_arch(str(manifest.get("model")))
    except ConfigError:
        return  # a model the planner does not read: dstk train --check asks AutoEP's own rule
    cfg = {"expert_parallel": expert_parallel_section(ep)}
    errors = [p.message for p in model_problems(cfg, arch) if p.severity == ERROR]
    if errors:
        raise ConfigError(f"--ep {ep}: " + "; ".join(errors))


def _expert_parallel(manifest: dict, ep: int) -> dict:
    """The target's {"expert_parallel": ep} (0: no AutoEP, every rank holding every expert) for --ep."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"--ep must be a positive integer, got {ep!r}")
    return {EP: 0 if ep == 1 else ep}


def _check_empty(out: Path) -> None:
    if out.exists() and any(not is_lock_file(p.name) for p in out.iterdir()):
        raise ConfigError(f"{out} already holds files; give a new OUT folder (reshard never overwrites a run)")


def _write(out: Path, ckpt_dir: Path, tag: str, manifest: dict, state, positions: list) -> int:
    """OUT/checkpoints: the run's dstk/ with `manifest`, the tag's state by HF name, its stream positions (a
    --streaming run's, found by replica on resume: toolkit.train.job.stream_position), `latest`; written in a
    temporary folder beside OUT and renamed into it, whole. Returns the state's bytes."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.dstk-", dir=out.absolute().parent))
    try:
        folder = RunFolder(tmp).checkpoints
        shutil.copytree(ckpt_dir / META, folder / META)
        write_manifest(folder, manifest)  # an older run's layout.json goes
        size = portable.write(state, folder / tag / portable.PORTABLE)
        for position in positions:
            shutil.copy2(position, folder / tag / position.name)
        write_latest(folder, tag)
        folder.rename(RunFolder(out).checkpoints)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return size


def _check_target(ckpt_dir: Path, manifest: dict, target: dict, layers) -> None:
    """The target layout the config rules would accept for this model (`layers`: its pipeline layers,
    None when unknown)."""
    pp, dp, sp, zero = target["pp"], target["dp"], target["sp"], target["zero_stage"]
    for key, value in (("--pp", pp), ("--dp", dp), ("--sp", sp)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {zero!r}")
    if pp > 1 and zero > 1:
        raise ConfigError(f"--zero {zero} with --pp {pp}: DeepSpeed's pipeline engine supports ZeRO 0 and 1 only; "
                          "use --zero 1, or --pp 1")
    if layers is not None and pp > layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {layers} pipeline layers; use --pp <= {layers}")
    if target["schedule"] == "dualpipev":
        _check_dualpipev(pp, sp, layers)
    if sp > 1:
        problems = _ulysses_problems(ckpt_dir, manifest, sp)
        if problems:
            raise ConfigError(f"--sp {sp}: " + "; ".join(problems))


def _check_dualpipev(pp: int, sp: int, layers) -> None:
    """--schedule dualpipev: 2 pp stages of this model, as `dstk train --schedule dualpipev` builds them."""
    if pp < 2:
        raise ConfigError(f"--schedule dualpipev needs --pp 2 or more (two stages per pipeline rank), got --pp {pp}")
    if sp > 1:
        raise ConfigError(f"--schedule dualpipev with --sp {sp}: dstk does not run Ulysses inside DualPipeV stages; "
                          "use --sp 1, or --schedule 1f1b")
    if layers is not None and 2 * pp > layers:
        raise ConfigError(f"--schedule dualpipev at --pp {pp} cuts 2 x pp = {2 * pp} stages, more than the model's "
                          f"{layers} pipeline layers; use --pp {layers // 2} or fewer")


def _pipeline_layers(ckpt_dir: Path, manifest: dict):
    """How many pipeline layers the model has (embedding, blocks, norm, head): a pipeline run's manifest
    says; else the saved config.json, as the planner counts them (None for a model it cannot read)."""
    from toolkit.plan.arch import load_arch

    names = manifest.get("hf_names")
    if manifest.get("pp", 1) > 1 and names:
        return len(names)
    try:
        return load_arch(str(ckpt_dir / META)).num_pipeline_layers
    except ConfigError:  # the resume's own build refuses a split it cannot make
        return None


def _ulysses_problems(ckpt_dir: Path, manifest: dict, sp: int) -> list:
    """What Ulysses needs of the model's heads and the run's seq-len at sp (none for a model the planner
    cannot read: the resume's own check refuses it then)."""
    from toolkit.config.rules.sequence_parallel import ulysses_problems
    from toolkit.plan.arch import load_arch

    try:
        arch = load_arch(str(ckpt_dir / META))
    except ConfigError:
        return []
    return ulysses_problems(arch.heads, arch.kv_heads, sp, manifest.get("seq_len"))
