"""`dstk export CHECKPOINT_DIR OUT_DIR`: a dstk-trained DeepSpeed checkpoint -> a HF directory."""

import click


@click.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--tag", metavar="TAG", help="Checkpoint tag (default: the one `latest` names).")
def export(checkpoint_dir, out_dir, tag):
    """Convert a DeepSpeed checkpoint (pipeline layers or ZeRO shards) to a HF directory."""
    from toolkit.train.export import export as export_checkpoint

    out = export_checkpoint(checkpoint_dir, out_dir, tag)
    click.echo(f"wrote {out} (safetensors, config.json, tokenizer)")
