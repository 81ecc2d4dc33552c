"""`dstk partition MODEL --pp P`: which layers go on which stage, and what each stage costs.

    dstk partition gpt2 --pp 4 --seq-len 512
    dstk partition llama-3-8b --pp 8 --seq-len 4096 --mbs 1 --json
    dstk partition path/to/hf_model --pp 4 --method profile     # times each layer here (torch)
    dstk partition gpt2 --pp 4 --config ds.json                 # record the split for training
    dstk partition llama-2-7b --pp 4 --lora 16                  # LoRA rank 16: the base frozen
    dstk partition meta-llama/Llama-3.2-1B --pp 4               # a hub id: config.json from the HF cache
    dstk partition deepseek-v3 --pp 16 --gpu-mem 1TiB           # least slowest stage with every stage <= 1 TiB

Built-in names, local directories and hub ids are read without importing torch (except --method profile).
"""


import click

from toolkit.cli import echo_json

from toolkit.plan.arch import builtin_names
from toolkit.plan.memory.precision import PRECISIONS
from toolkit.plan.cost.partition import METHODS


@click.command(epilog=f"Built-in models (the same in every command): {builtin_names()}.")
@click.argument("model", metavar="MODEL")
@click.option("--pp", type=click.IntRange(min=1), required=True, metavar="P", help="Pipeline stages.")
@click.option("--seq-len", type=click.IntRange(min=1), metavar="S",
              help="Tokens per sequence (default: the model's max positions, at most 1024).")
@click.option("--mbs", type=click.IntRange(1, 2**31 - 1), default=1, show_default=True, metavar="B",
              help="Micro-batch size per GPU (sequences).")
@click.option("--method", default="compute", show_default=True, metavar="M",
              help=f"How to balance stages: {', '.join(METHODS)}.")
@click.option("--precision", type=click.Choice(sorted(PRECISIONS)), default="bf16", show_default=True,
              help="Bytes per parameter state and activation in the memory estimate; with --method profile on "
                   "a GPU, the dtype the layers are timed in (the CPU times fp32).")
@click.option("--attention", type=click.Choice(["sdpa", "eager"]), default="sdpa", show_default=True,
              help="sdpa/flash keeps no (seq x seq) attention matrix for backward; eager does.")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed repetitions per layer for --method profile.")
@click.option("--lora", type=int, metavar="R",
              help="LoRA fine-tuning: rank-R adapters on every block linear train, the base is frozen (weights "
                   "only in the memory estimate; no weight gradients in the compute; --method profile still "
                   "times full fine-tuning).")
@click.option("--gpu-mem", "gpu_mem", metavar="SIZE",
              help="Memory a stage may hold, e.g. 80GiB: the compute split is then the least slowest stage among "
                   "the splits whose every stage's memory (as the table counts it: no ZeRO sharding) fits SIZE.")
@click.option("--revision", default="main", show_default=True, metavar="REV",
              help="Branch, tag or commit of a hub id (ORG/NAME) in MODEL.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report on stdout.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Record the split in FILE's pipeline section (stages, partition_method, parts) for every rank; "
                   "--mbs and --precision default to FILE's (train_micro_batch_size_per_gpu, bf16/fp16).")
def partition(model, pp, seq_len, mbs, method, precision, attention, reps, lora, gpu_mem, revision, as_json,
              config_path):
    """Split MODEL (a built-in name such as gpt2, llama-3-8b, a local HF directory, or a hub id ORG/NAME
    read from the Hugging Face cache: downloaded when online; offline, HF_HUB_OFFLINE=1, filled beforehand
    by `hf download ORG/NAME`) into P pipeline stages; compare with DeepSpeed's `parameters` and `uniform`
    splits."""
    from toolkit.errors import ConfigError
    from toolkit.plan.arch import load_arch
    from toolkit.plan.lora import check_lora_rank
    from toolkit.plan.cost.partition_report import format_report, stage_report

    if lora is not None:
        check_lora_rank(lora)
    if config_path:
        mbs, precision = _config_defaults(config_path, mbs, precision)
    if gpu_mem is not None:
        from toolkit.plan.gpus import parse_size

        gpu_mem = parse_size(gpu_mem, "--gpu-mem")
        if method != "compute":
            raise ConfigError(f"--gpu-mem limits the stages of --method compute, not --method {method}: drop "
                              "--gpu-mem, or use --method compute")
    arch = load_arch(model, revision)
    seq_len = seq_len or min(1024, arch.max_positions)
    times = None
    if method == "profile":  # check the cheap things before minutes of timing
        from toolkit.plan.cost.layers import check_shape
        from toolkit.plan.cost.partition import check_stages
        from toolkit.plan.cost.profile import profile_model

        check_stages(arch.num_pipeline_layers, pp)
        check_shape(arch, seq_len, mbs)
        times = profile_model(model, seq_len, mbs, reps=reps, precision=precision, revision=revision)
    report = stage_report(arch, pp, seq_len, mbs, method=method, precision=precision, times=times,
                          attention=attention, lora=lora, memory_limit=gpu_mem)
    echo_json(report.to_dict()) if as_json else click.echo(format_report(report))
    if config_path:
        from toolkit.config.generate import record_partition

        record_partition(config_path, pp, method, report.splits[0].parts)
        click.echo(f"recorded parts {report.splits[0].parts} in {config_path}", err=True)


def _config_defaults(path: str, mbs: int, precision: str) -> tuple:
    """(mbs, precision): those the command line gave, else the --config file's (the split is recorded for the
    runs that file configures); "auto" or absent values keep the command's defaults. Said on stderr."""
    from click.core import ParameterSource

    from toolkit.config.loader import load_config
    from toolkit.config.problems import raise_errors

    cfg, problems = load_config(path)
    raise_errors(problems, path)
    given = click.get_current_context().get_parameter_source
    read = []
    file_mbs = cfg.get("train_micro_batch_size_per_gpu")
    if given("mbs") == ParameterSource.DEFAULT and isinstance(file_mbs, int):
        mbs = file_mbs
        read.append(f"mbs {mbs}")
    enabled = {key: (cfg.get(key) or {}).get("enabled") for key in ("fp16", "bf16", "bfloat16")}
    if given("precision") == ParameterSource.DEFAULT and "auto" not in enabled.values():
        precision = "fp16" if enabled["fp16"] is True else "bf16" if True in (enabled["bf16"], enabled["bfloat16"]) \
            else "fp32"
        read.append(precision)
    if read:
        click.echo(f"from {path}: {', '.join(read)}", err=True)
    return mbs, precision
