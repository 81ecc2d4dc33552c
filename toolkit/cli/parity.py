"""`dstk parity`: check a wrapped model computes what the HF model computes (exit 1 if not)."""


import click

from models import TASKS
from toolkit.cli import echo_json
from toolkit.plan.arch import builtin_names


@click.command("parity", epilog=f"Built-in models (the same in every command): {builtin_names()}.")
@click.argument("model", metavar="MODEL")
@click.option("--task", type=click.Choice(list(TASKS)),
              help="Head to wrap (default: causal-lm, masked-lm for bert).")
@click.option("--seq-len", type=int, default=8, show_default=True, metavar="T",
              help="Tokens per sequence: >= 4 (>= 2 with --no-pad), at most the model's max_position_embeddings.")
@click.option("--attention", type=click.Choice(["eager", "sdpa"]), help="Attention implementation (default: HF's).")
@click.option("--attn", type=click.Choice(["eager", "sdpa"]), hidden=True)  # the old name of --attention
@click.option("--no-pad", is_flag=True, help="Do not right-pad the first sequence of the batch.")
@click.option("--revision", default="main", show_default=True, metavar="REV",
              help="Branch, tag or commit of a hub id (ORG/NAME) in MODEL.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def parity(ctx, model, task, seq_len, attention, attn, no_pad, revision, as_json):
    """Compare loss, logits and gradients of MODEL and its pipeline layer list.

    MODEL is a local HF directory, a hub id (ORG/NAME, read from the Hugging Face cache: downloaded when
    online; offline, HF_HUB_OFFLINE=1, filled beforehand by `hf download ORG/NAME`), a built-in name (its
    published dimensions, random weights) or a transformers model type (small dimensions, random weights).

    \b
    dstk parity llama
    dstk parity path/to/hf_model --seq-len 32
    dstk parity Qwen/Qwen2.5-0.5B
    """
    from dataclasses import asdict

    from toolkit.train.parity import TOLERANCE, run_parity

    if attention and attn and attention != attn:
        raise click.UsageError(f"--attention {attention} and --attn {attn} disagree; --attn is the old name of "
                               "--attention: give --attention alone")
    report = run_parity(model, task=task, seq_len=seq_len, pad=not no_pad, attn_implementation=attention or attn,
                        revision=revision)
    if as_json:
        echo_json({**asdict(report), "ok": report.ok, "tolerance": TOLERANCE})
    else:
        click.echo(f"{report.model} ({report.task}, {report.num_layers} pipeline layers, "
                   f"{report.attn_implementation} attention): loss {report.loss_hf:.6f}")
        click.echo(f"  loss   max abs diff {report.loss_diff:.3e}")
        click.echo(f"  logits max abs diff {report.logits_diff:.3e}")
        click.echo(f"  grads  max abs diff {report.grad_diff:.3e} over {report.params_checked} parameters"
                   + (f" (worst: {report.grad_name})" if report.grad_name else ""))
        click.echo(f"{'OK' if report.ok else 'FAIL'}: tolerance {TOLERANCE:g}")
    if not report.ok:
        ctx.exit(1)
