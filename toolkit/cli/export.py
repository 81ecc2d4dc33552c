"""`dstk export CHECKPOINT_DIR OUT_DIR`: a dstk-trained DeepSpeed checkpoint -> a HF directory."""

from pathlib import Path

import click


@click.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--tag", metavar="TAG", help="Checkpoint tag, e.g. global_step500 (default: the one `latest` names).")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Weights' type in OUT_DIR: fp32 as trained, bf16/fp16 half the bytes (config.json says which).")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="Largest safetensors file, e.g. 500MB or 2GB; more than one: model-0000k-of-0000n.safetensors "
              "+ model.safetensors.index.json.")
@click.option("--merge/--no-merge", default=True, show_default=True,
              help="A LoRA run: OUT_DIR gets the adapters merged into full weights; --no-merge: the adapters alone "
              "(PEFT's adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained).")
@click.option("--adapter-dir", type=click.Path(file_okay=False), metavar="DIR",
              help="A LoRA run: also write the adapters alone (PEFT's format) into DIR.")
@click.option("--trust-checkpoint", is_flag=True, help="Load the checkpoint's .pt files as pickles, unchecked "
              "(torch.load weights_only=False), for a checkpoint from a source you trust that holds classes other than "
              "DeepSpeed's; by default any other class is refused before loading (a pickle can run code).")
def export(checkpoint_dir, out_dir, tag, force, dtype, max_shard_size, merge, adapter_dir, trust_checkpoint):
    """Convert a DeepSpeed checkpoint (pipeline layers or ZeRO shards) to a HF directory.

    CHECKPOINT_DIR is a run's checkpoints/ folder, or the run's --out folder that holds it.
    OUT_DIR is written whole or not at all. A full model is streamed: about one layer is in
    memory at a time (a LoRA run's merge loads the whole model).

    \b
    dstk export runs/dstk runs/dstk/hf_again
    dstk export runs/dstk/checkpoints exported --tag global_step500 --force
    dstk export runs/big runs/big/hf_bf16 --dtype bf16 --max-shard-size 2GB
    dstk export runs/lora runs/lora/adapter_500 --tag global_step500 --no-merge
    """
    from toolkit.cli import trust_checkpoints
    from toolkit.export.directory import export as export_checkpoint
    from toolkit.export.directory import find_checkpoint_dir

    trust_checkpoints(trust_checkpoint)
    found = find_checkpoint_dir(checkpoint_dir)
    if found != Path(checkpoint_dir):
        click.echo(f"reading {found} (the checkpoints of run {checkpoint_dir})", err=True)
    out = export_checkpoint(found, out_dir, tag, overwrite=force, dtype=dtype, adapter_dir=adapter_dir, merge=merge,
                            max_shard_size=max_shard_size)
    what = "the adapters in PEFT's format" if not merge else f"{dtype} safetensors, config.json"
    click.echo(f"wrote {out} ({what}, tokenizer)" + (f" and the adapters in {adapter_dir}" if adapter_dir and merge
                                                     else ""))
