"""`dstk schedule`: draw DeepSpeed's 1F1B TrainSchedule, one row per stage, and its bubble; with
--schedule dualpipev, DeepSpeed's DualPipeVSchedule timed next to 1F1B's for the same pp and gas."""


import click

from toolkit.cli import echo_json


@click.command("schedule")
@click.option("--pp", type=int, required=True, metavar="P", help="Pipeline stages.")
@click.option("--gas", type=int, metavar="M",
              help="Gradient accumulation steps = micro-batches per step (gradient_accumulation_steps). Required.")
@click.option("--micro-batches", "-m", "micro_batches", type=int, hidden=True)  # the old name of --gas
@click.option("--png", type=click.Path(dir_okay=False), metavar="FILE.png",
              help="Also render the timeline to FILE.png (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON instead of ASCII.")
@click.option("--schedule", "kind", type=click.Choice(["1f1b", "dualpipev"]), default="1f1b", show_default=True,
              help="dualpipev: DeepSpeed's DualPipeV instruction stream next to 1F1B's, timed (needs --gas >= 2 x pp).")
def schedule(pp, gas, micro_batches, png, as_json, kind):
    """Draw DeepSpeed's own 1F1B schedule for P stages and M micro-batches.

    \b
    dstk schedule --pp 4 --gas 8
    dstk schedule --pp 4 --gas 8 --png schedule.png
    dstk schedule --pp 4 --gas 8 --schedule dualpipev
    """
    from toolkit.plan.schedule import check_png_path, render_ascii, render_png, train_timeline

    gas = _one_gas(gas, micro_batches)
    if png:
        check_png_path(png)  # before DeepSpeed is imported and the timeline computed
    if kind == "dualpipev":
        return _dualpipev(pp, gas, png, as_json)
    timeline = train_timeline(pp, gas)
    if png:
        render_png(timeline, png)
    echo_json(timeline.to_dict()) if as_json else click.echo(render_ascii(timeline))
    if png:
        click.echo(f"wrote {png}", err=True)


def _one_gas(gas, micro_batches):
    """--gas, or its old name --micro-batches/-m; both only when they agree."""
    if gas is None and micro_batches is None:
        raise click.UsageError("Missing option '--gas' (micro-batches per step).")
    if gas is not None and micro_batches is not None and gas != micro_batches:
        raise click.UsageError(f"--gas {gas} and --micro-batches {micro_batches} disagree; --micro-batches is "
                               "the old name of --gas: give --gas alone")
    return gas if gas is not None else micro_batches


def _dualpipev(pp: int, gas: int, png, as_json: bool) -> None:
    from toolkit.plan import dualpipev

    timed = dualpipev.timelines(pp, gas)
    if png:
        dualpipev.render_png(timed, png)
    echo_json({name: t.to_dict() for name, t in timed.items()}) if as_json else click.echo(dualpipev.render_ascii(timed))
    if png:
        click.echo(f"wrote {png}", err=True)
