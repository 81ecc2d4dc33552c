"""`dstk generate-config`: options -> a DeepSpeed config that fits the topology, or a clear refusal.

Help text for options that map to one DeepSpeed key comes from the schema's descriptions. The shipped presets
(toolkit.config.presets) are this command's output: `python -m toolkit.cli.generate` writes them again
(`make presets`).
"""

import shlex

import click

from toolkit.config import options as opts
from toolkit.config.schema import describe


def _betas(ctx, param, value):
    try:
        b1, b2 = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two numbers like 0.9,0.999, got {value!r}") from None
    return (b1, b2)


def _choice(values):
    return click.Choice(values, case_sensitive=False)


@click.command("generate-config")
@click.option("--strategy", type=_choice(opts.STRATEGIES), help="dp: replicate; pp: one replica split in stages; hybrid: dp x pp. Inferred when omitted.")
@click.option("--world-size", type=int, metavar="N", help="Total processes (GPUs). Default: --nodes x --gpus-per-node, else --pp.")
@click.option("--nodes", type=int, metavar="N", help="Nodes (with --gpus-per-node) instead of --world-size.")
@click.option("--gpus-per-node", type=int, metavar="N", help="GPUs per node (with --nodes).")
@click.option("--pp", type=int, default=1, show_default=True, metavar="N", help="Pipeline stages (pp); written as pipeline.stages.")
@click.option("--tp", type=int, default=1, show_default=True, metavar="N", help="Tensor-parallel size (DeepSpeed AutoTP; with --pp > 1 dstk train shards each pipeline stage's blocks itself): written as tensor_parallel.autotp_size; dp = world / (pp x tp). With --tp > 1 train_batch_size is left out (DeepSpeed 0.19 checks it against the world size).")
@click.option("--ep", type=int, default=1, show_default=True, metavar="N", help="Expert-parallel size (DeepSpeed AutoEP, MoE models): each group of N consecutive data-parallel ranks shares one copy of the experts, each rank holding experts / N of them; written as expert_parallel.autoep_size with enabled: true. N divides world / pp and each MoE block's experts (check with `dstk validate --model`).")
@click.option("--ep-preset", metavar="NAME", help="AutoEP preset for the model's MoE modules (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3, minimax_m3): written as expert_parallel.preset_model. Default: AutoEP tries each.")
@click.option("--sp", type=int, default=1, show_default=True, metavar="N", help="Ulysses sequence-parallel size (any --pp, tp = 1): each group of N ranks shares its rows, each rank holding 1/N of the sequence; written as sequence_parallel_size; dp = world / (pp x sp x tp).")
@click.option("--partition-method", default="compute", show_default=True, metavar="METHOD", help=describe("pipeline.partition_method"))
@click.option("--mbs", type=int, default=1, show_default=True, metavar="N", help=describe("train_micro_batch_size_per_gpu"))
@click.option("--gbs", type=int, metavar="N", help=describe("train_batch_size") + " Derived from --gas when omitted.")
@click.option("--gas", type=int, metavar="N", help=describe("gradient_accumulation_steps") + " Derived from --gbs when omitted.")
@click.option("--zero", type=click.IntRange(0, 3), metavar="0-3",
              help="ZeRO stage: 0 off, 1 partitions optimizer states, 2 also gradients, 3 also parameters. "
              "Default: 1 under bf16 (with data_types.grad_accum_dtype fp32: DeepSpeed sums gradients in fp32 only "
              "at ZeRO >= 1), else 0.")
@click.option("--precision", type=_choice(opts.PRECISIONS), help="Training precision (default fp32).")
@click.option("--bf16", is_flag=True, help="Same as --precision bf16.")
@click.option("--fp16", is_flag=True, help="Same as --precision fp16.")
@click.option("--loss-scale", type=float, default=0.0, show_default=True,
              help="fp16: a fixed loss scale, or 0 for dynamic loss scaling.")
@click.option("--initial-scale-power", type=int, default=16, show_default=True, metavar="POWER",
              help="fp16: dynamic loss scaling starts at 2**POWER (0-127).")
@click.option("--loss-scale-window", type=int, default=1000, show_default=True,
              help="fp16: steps without overflow before the dynamic loss scale doubles.")
@click.option("--hysteresis", type=int, default=2, show_default=True,
              help="fp16: overflows tolerated before the dynamic loss scale halves.")
@click.option("--min-loss-scale", type=float, default=1.0, show_default=True,
              help="fp16: the dynamic loss scale never drops below this (> 0).")
@click.option("--optimizer", type=_choice(opts.OPTIMIZERS), default="AdamW", show_default=True,
              help="Optimizer DeepSpeed builds (any case), or none when the training script brings its own. "
              "Adam/AdamW: torch's (fused on GPUs); Lamb is DeepSpeed's FusedLamb and --offload-optimizer uses "
              "DeepSpeedCPUAdam, both JIT-built at the first run (Lamb needs nvcc). For Lion, Muon or a "
              "torch.optim class, edit the written config.")
@click.option("--fused-adam", is_flag=True,
              help="Adam/AdamW: DeepSpeed's FusedAdam instead of torch's fused AdamW (a CUDA op JIT-built at the "
              "first run: needs nvcc and CUDA_HOME, and minutes).")
@click.option("--lr", type=float, default=1e-4, show_default=True, help="Peak learning rate, > 0 (LRRangeTest: the starting one).")
@click.option("--betas", default="0.9,0.999", show_default=True, callback=_betas, metavar="B1,B2", help="Adam/AdamW/Lamb betas.")
@click.option("--eps", type=float, default=1e-8, show_default=True, help="Optimizer epsilon, >= 0.")
@click.option("--weight-decay", type=float, default=0.01, show_default=True, help="Weight decay, >= 0.")
@click.option("--momentum", type=float, default=0.0, show_default=True, help="SGD momentum, >= 0.")
@click.option("--scheduler", type=_choice(opts.SCHEDULERS), default="none", show_default=True,
              help="Learning-rate schedule DeepSpeed builds (any case; written as spelled here), or none.")
@click.option("--warmup-steps", type=int, default=0, show_default=True,
              help="Warm-up steps (OneCycle: steps of the rising half; LRRangeTest: steps between lr increases).")
@click.option("--total-steps", type=int, help="Total training steps (WarmupDecayLR, WarmupCosineLR).")
@click.option("--warmup-min-lr", type=float, default=0.0, show_default=True, help="Learning rate at step 0 (OneCycle: the cycle's minimum).")
@click.option("--grad-clip", "gradient_clipping", type=float, default=1.0, show_default=True, help=describe("gradient_clipping") + " Always written: DeepSpeed clips at 1.0 when the key is absent.")
@click.option("--offload-optimizer", type=_choice(opts.OFFLOAD_DEVICES), default="none", show_default=True,
              help="Keep optimizer states in host memory (cpu) or on --nvme-path (nvme); the optimizer step "
              "then runs on the CPU. Needs --zero >= 1.")
@click.option("--offload-param", type=_choice(opts.OFFLOAD_DEVICES), default="none", show_default=True,
              help="Keep parameters in host memory (cpu) or on --nvme-path (nvme). Needs --zero 3.")
@click.option("--nvme-path", metavar="DIR", help="A fast local disk for --offload-optimizer/--offload-param nvme.")
@click.option("--activation-checkpointing/--no-activation-checkpointing", default=False, show_default=True, help="Recompute activations in the backward pass (pipeline: every layer).")
@click.option("--monitor", "monitors", multiple=True, type=_choice(opts.MONITORS), help="Log to tensorboard / csv / wandb (repeatable).")
@click.option("--monitor-dir", default="runs/monitor", show_default=True, metavar="DIR",
              help="Where tensorboard and csv monitors write, relative to where training starts.")
@click.option("--job-name", default="dstk", show_default=True, metavar="NAME",
              help="Monitor run name: a folder under --monitor-dir (wandb: the project).")
@click.option("--steps-per-print", type=int, default=10, show_default=True, metavar="N",
              help="DeepSpeed logs progress every N optimizer steps (N >= 1).")
@click.option("--hf", is_flag=True, help='Write "auto" where the HF Trainer / Accelerate fill values (pp = 1 only).')
@click.option("--cpu", is_flag=True, help="CPU-only machines: torch's Adam (no JIT-built ops), no fp16, no offload.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to FILE (atomically) instead of stdout.")
@click.option("--force", is_flag=True, help="Overwrite an existing --output file.")
def generate_config(output, force, bf16, fp16, **kwargs):
    """Generate a DeepSpeed config whose batch numbers fit the topology.

    \b
    dstk generate-config --strategy hybrid --world-size 8 --pp 4 --mbs 2 --gbs 64 --zero 1 --bf16 -o ds.json
    """
    from toolkit.config.rules.accumulation import accumulation_problems
    from toolkit.config.generate import build_config, dumps, write_config

    kwargs["precision"] = _precision(kwargs["precision"], bf16, fp16)
    kwargs["optimizer"] = _canonical(kwargs["optimizer"], opts.OPTIMIZERS)
    kwargs["scheduler"] = _canonical(kwargs["scheduler"], opts.SCHEDULERS)
    kwargs["monitors"] = tuple(m.lower() for m in kwargs["monitors"])
    cfg = build_config(opts.GenerateOptions(**kwargs))
    for problem in accumulation_problems(cfg):  # asked for (--bf16 --zero 0): said once, as validate says it
        click.echo(str(problem), err=True)
    if output:
        write_config(cfg, output, force=force)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(dumps(cfg), nl=False)


def _precision(precision, bf16, fp16) -> str:
    """The one precision asked for by --precision, --bf16 and --fp16; a UsageError naming the flags when they differ."""
    asked = [(f"--precision {precision}", precision.lower())] if precision else []
    asked += [(flag, name) for flag, name, on in (("--bf16", "bf16", bf16), ("--fp16", "fp16", fp16)) if on]
    names = {name for _, name in asked}
    if len(names) > 1:
        why = " (DeepSpeed asserts fp16 and bf16 are not both enabled)" if {"bf16", "fp16"} <= names else ""
        raise click.UsageError(f"{' and '.join(flag for flag, _ in asked)} ask for different precisions{why}; "
                               "give one of them")
    return names.pop() if names else "fp32"


def _canonical(value: str, names) -> str:
    return next(n for n in names if n.lower() == value.lower())


def render(args: list[str]) -> str:
    """The JSON text `dstk generate-config ARGS` prints."""
    from click.testing import CliRunner

    result = CliRunner().invoke(generate_config, args, catch_exceptions=False)
    if result.exit_code:
        raise SystemExit(f"generate-config {shlex.join(args)} failed: {result.output}")
    return result.output


def write_presets() -> None:
    """Every preset in ds_configs/ written again from its recorded command (ds_configs/presets.txt)."""
    from toolkit.config.presets import PRESET_DIR, load_presets

    for name, args in load_presets().items():
        (PRESET_DIR / name).write_text(render(args))
        click.echo(f"wrote ds_configs/{name}: dstk generate-config {shlex.join(args)}", err=True)


if __name__ == "__main__":
    write_presets()
