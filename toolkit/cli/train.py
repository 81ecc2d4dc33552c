"""`dstk train`: run on every rank by the launcher (see launch.sh); parse, call toolkit.train.run, print."""

import json

import click


@click.command()
@click.option("--model", required=True, metavar="DIR|NAME", help="Local HF model directory, or a built-in "
              "architecture with random weights: tiny-gpt2, small-gpt2, tiny-llama, tiny-bert.")
@click.option("--data", required=True, metavar="FILE", help=".txt (blank-line separated documents) or .jsonl "
              "(text; prompt/response; text/label for --task classification).")
@click.option("--config", "--deepspeed-config", "--deepspeed_config", "config", required=True, metavar="JSON",
              help="DeepSpeed config (from `dstk generate-config`).")
@click.option("--out", default="runs/dstk", show_default=True, metavar="DIR",
              help="Run folder: checkpoints/, hf/ (the export), metrics.jsonl.")
@click.option("--tokenizer", metavar="DIR", help="Tokenizer directory (default: the model's; bytes for built-ins).")
@click.option("--task", type=click.Choice(["causal-lm", "classification"]), default="causal-lm", show_default=True)
@click.option("--pp", type=int, help="Pipeline stages (default: the config's pipeline.stages, else 1).")
@click.option("--seq-len", type=int, default=128, show_default=True, help="Tokens per row.")
@click.option("--steps", type=int, help="Optimizer steps (default: one epoch).")
@click.option("--eval-every", type=int, default=0, show_default=True, help="Steps between eval losses (0: at the end).")
@click.option("--eval-batches", type=int, default=2, show_default=True, help="Global batches per evaluation.")
@click.option("--save-every", type=int, default=0, show_default=True, help="Steps between checkpoints (0: at the end).")
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoints/latest with the same data order.")
@click.option("--seed", type=int, default=1234, show_default=True, help="Model init and data order.")
@click.option("--eval-fraction", type=float, default=0.05, show_default=True, help="Share of rows held out.")
@click.option("--text-field", default="text", show_default=True, help="JSONL key holding the text.")
@click.option("--export/--no-export", default=True, show_default=True, help="Write OUT/hf at the end.")
@click.option("--progress/--no-progress", default=True, help="tqdm bar on rank 0.")
@click.option("--crash-at-step", type=int, hidden=True)
@click.option("--local_rank", "--local-rank", "local_rank", type=int, hidden=True, help="Set by the deepspeed launcher.")
def train(local_rank, **options):
    """Train a HF model (run on every rank by the launcher)."""
    from toolkit.train import TrainArgs, run, shutdown

    summary = run(TrainArgs(**options))
    if summary.get("rank0"):
        click.echo("summary: " + json.dumps({k: v for k, v in summary.items() if k != "rank0"}))
    shutdown()
