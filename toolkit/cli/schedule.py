"""`dstk schedule`: draw DeepSpeed's 1F1B TrainSchedule, one row per stage, and its bubble."""

import json

import click


@click.command("schedule")
@click.option("--pp", type=int, required=True, metavar="P", help="Pipeline stages.")
@click.option("--micro-batches", "-m", type=int, required=True, metavar="M",
              help="Micro-batches per step (= gradient_accumulation_steps).")
@click.option("--png", type=click.Path(dir_okay=False), metavar="FILE", help="Also render the timeline to FILE (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON instead of ASCII.")
def schedule(pp, micro_batches, png, as_json):
    """Draw DeepSpeed's own 1F1B schedule for P stages and M micro-batches.

    \b
    dstk schedule --pp 4 --micro-batches 8
    dstk schedule --pp 4 -m 8 --png schedule.png
    """
    from toolkit.plan.schedule import render_ascii, render_png, train_timeline

    timeline = train_timeline(pp, micro_batches)
    if png:
        render_png(timeline, png)
    click.echo(json.dumps(timeline.to_dict(), indent=2) if as_json else render_ascii(timeline))
    if png:
        click.echo(f"wrote {png}", err=True)
