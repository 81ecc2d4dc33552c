"""The program every rank runs. Any of these starts it (the config decides the layout):

    ./launch.sh --num-gpus 2 --config ds.json -- --model tiny-gpt2 --data corpus.txt --steps 50
    deepspeed --num_gpus 2 --module toolkit.train --config ds.json --model tiny-gpt2 --data corpus.txt
    torchrun --nproc-per-node 2 -m toolkit.train --config ds.json --model tiny-gpt2 --data corpus.txt

pp = 1: the HF model itself under deepspeed.initialize (ZeRO 1/2/3 apply). pp > 1: the model's
layer list (models/) as a PipelineModule over PipeDataParallelTopology(pp, dp), stepped with
train_batch(). Every rank checks the config against the real world size before building anything.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit import checkpoint
from toolkit.errors import ConfigError
from toolkit.topology import Topology


@dataclass
class TrainArgs:
    model: str  # local HF directory, or a built-in name (toolkit.train_models.BUILTIN)
    data: str  # .txt or .jsonl (see toolkit.data)
    config: str  # DeepSpeed JSON
    out: str = "runs/dstk"  # out/checkpoints (DeepSpeed's), out/hf (the export), out/metrics.jsonl
    tokenizer: str | None = None
    task: str = "causal-lm"  # or "classification"
    pp: int | None = None  # pipeline stages; default: the config's pipeline.stages, else 1
    seq_len: int = 128
    steps: int | None = None  # optimizer steps; default: one epoch
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 2  # optimizer-step-sized eval batches per evaluation
    save_every: int = 0  # 0: only at the end
    resume: bool = False
    seed: int = 1234
    eval_fraction: float = 0.05
    text_field: str = "text"
    export: bool = True
    progress: bool = True
    crash_at_step: int | None = None  # testing: SIGKILL the last rank after this step


def init_distributed():
    """torch.distributed from the launcher's env (or a world of one); gloo and no JIT ops on CPU."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # started by hand: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else a 2-minute JIT build
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_checked_config(path: str, world_size: int, pp: int | None) -> tuple[dict, int]:
    """The DeepSpeed dict and pp, after toolkit.config's rules for this world; all errors raised."""
    import hjson

    from toolkit.config.problems import has_errors
    from toolkit.config.rules import check_rules

    if not Path(path).is_file():
        raise ConfigError(f"DeepSpeed config {path!r} does not exist; make one with `dstk generate-config`")
    cfg = json.loads(json.dumps(hjson.loads(Path(path).read_text())))  # OrderedDict -> dict
    problems = check_rules(cfg, world_size=world_size, pp=pp)
    if has_errors(problems):
        lines = "\n  ".join(str(p) for p in problems if p.severity == "error")
        raise ConfigError(f"{path} does not fit world size {world_size}:\n  {lines}")
    stages = pp or cfg.get("pipeline", {}).get("stages") or 1
    return cfg, stages


def run(args: TrainArgs) -> dict:
    """Train, checkpoint and export; returns the summary (the same dict on every rank)."""
    import torch.distributed as dist

    from toolkit import train_loop

    init_distributed()
    cfg, pp = read_checked_config(args.config, dist.get_world_size(), args.pp)
    topo = Topology(dist.get_world_size(), pp)
    stage, dp_rank = topo.coords(dist.get_rank())
    job = train_loop.prepare(args, cfg, topo, dp_rank)
    summary = train_loop.loop(args, job, is_logger=dist.get_rank() == 0)
    if args.export and dist.get_rank() == 0:
        out = Path(args.out) / "hf"
        checkpoint.export(Path(args.out) / "checkpoints", out)
        summary["export"] = str(out)
    dist.barrier()
    summary["rank0"] = dist.get_rank() == 0
    job.engine.destroy()  # autograd hooks keep an engine (and its buffers) alive otherwise
    return summary


def shutdown() -> None:
    """End of a training process: tear the process group down explicitly. Left to interpreter exit,
    gloo's threads can abort a rank after a successful run ("terminate called without an active
    exception", exit -6). Only the process entry calls this: an in-process caller keeps its group."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main():
    """`python -m toolkit.train ...`: the same options as `dstk train`."""
    from toolkit.cli import main as cli_main
    import sys

    cli_main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    main()
