"""`dstk reshard CHECKPOINT_DIR OUT_DIR --pp N [--dp M --sp S --zero Z --schedule S --ep E]`: a checkpoint ready for another
layout."""


import click

from toolkit.cli import echo_json, trust_checkpoints


@click.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--pp", type=int, metavar="N", help="Pipeline stages of the layout to resume on (default: unchanged).")
@click.option("--dp", type=int, metavar="M", help="Data-parallel replicas of that layout (default: unchanged).")
@click.option("--sp", type=int, metavar="S", help="Sequence-parallel (Ulysses) size of that layout, with any --pp "
              "(1F1B; not with --schedule dualpipev; default: unchanged).")
@click.option("--zero", type=int, metavar="Z", help="ZeRO stage of that layout, 0-3 (0-1 with pp > 1; default: unchanged).")
@click.option("--schedule", type=click.Choice(["1f1b", "dualpipev"]), help="Pipeline schedule of that layout "
              "(dualpipev: 2 pp stages, `dstk train --schedule dualpipev`; default: unchanged).")
@click.option("--ep", type=int, metavar="E", help="Expert-parallel (DeepSpeed AutoEP) size of that layout, ZeRO "
              "0-3, from or to pp 1 (a pipeline's ep moves off it, not onto it); 1: no AutoEP, every expert on every "
              "rank (default: unchanged).")
@click.option("--tag", metavar="TAG", help="Checkpoint tag, e.g. global_step500 (default: the one `latest` names).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@click.option("--trust-checkpoint", is_flag=True, help="Load the checkpoint's .pt files as pickles, unchecked "
              "(torch.load weights_only=False), for a checkpoint from a source you trust that holds classes other than "
              "DeepSpeed's; by default any other class is refused before loading (a pickle can run code).")
def reshard(checkpoint_dir, out_dir, pp, dp, sp, zero, schedule, ep, tag, as_json, trust_checkpoint):
    """Make a run's checkpoint resumable on another layout (pp, dp, sp, ZeRO stage, ep), offline.

    OUT_DIR becomes a run folder holding the checkpoint's weights, Adam moments, optimizer step, LR
    schedule and step counters by HF name; continue the run there with `dstk train --out OUT_DIR --resume`
    and a config of the new layout. (`--resume` on another layout straight from the run also works; this
    does the conversion once, so each rank then reads only its own tensors.)

    \b
    dstk reshard runs/big runs/big_pp2 --pp 2 --dp 4
    dstk reshard runs/big/checkpoints runs/big_z0 --zero 0 --tag global_step500 --json
    dstk reshard runs/long runs/long_sp1 --sp 1 --dp 8
    dstk reshard runs/big runs/big_dpv --pp 4 --schedule dualpipev
    dstk reshard runs/moe runs/moe_ep1 --ep 1
    """
    from toolkit.checkpoint.reshard import reshard_checkpoint

    trust_checkpoints(trust_checkpoint)
    done = reshard_checkpoint(checkpoint_dir, out_dir, tag, pp, dp, zero, sp, schedule, ep)
    if as_json:
        echo_json(done, indent=1)
        return
    src, dst = done["from"], done["to"]
    click.echo(f"wrote {done['out']}: {done['tag']} ({done['tensors']} tensors, {done['bytes'] / 2**20:.1f} MiB "
               f"of fp32 weights and moments), {_layout(src)} -> {_layout(dst)}")
    click.echo(f"continue with: {done['resume']}")


def _layout(layout: dict) -> str:
    return (f"pp {layout['pp']} dp {layout['dp']} sp {layout['sp']} ZeRO {layout['zero_stage']}"
            + (" dualpipev" if layout.get("schedule") == "dualpipev" else "")
            + (f" ep {layout['expert_parallel']}" if layout.get("expert_parallel") else ""))
