"""The `dstk` command. Sub-commands are loaded lazily: `dstk --help` imports none of them.

Each entry maps a command name to "module:attribute" and the one-line help shown by `--help`,
so listing commands never imports a command module (and so never torch or deepspeed).
"""

import contextlib
import importlib
import io
import os
import sys

import click

from toolkit import __version__
from toolkit.errors import ConfigError, UnusableInput

COMMANDS = {
    "generate-config": ("toolkit.cli.generate:generate_config", "Generate a DeepSpeed config for a topology."),
    "validate": ("toolkit.cli.validate:validate", "Validate DeepSpeed config files (schema and rules)."),
    "schema": ("toolkit.cli.validate:schema", "Print the JSON Schema of DeepSpeed configs."),
    "partition": ("toolkit.cli.partition:partition", "Split a model's layers into pipeline stages."),
    "parity": ("toolkit.cli.parity:parity", "Check a wrapped model computes what the HF model computes."),
    "plan": ("toolkit.cli.plan:plan", "Estimate memory and speed of every layout; recommend one."),
    "schedule": ("toolkit.cli.schedule:schedule", "Draw DeepSpeed's 1F1B pipeline schedule."),
    "train": ("toolkit.cli.train:train", "Train a HF model (run on every rank by the launcher)."),
    "export": ("toolkit.cli.export:export", "Convert a DeepSpeed checkpoint to a HF directory."),
    "reshard": ("toolkit.cli.reshard:reshard", "Make a checkpoint resumable on another layout (pp, dp, ZeRO)."),
}


class LazyGroup(click.Group):
    """A group whose commands are imported only when invoked (or their own --help is asked)."""

    def list_commands(self, ctx):
        return [name for name, (target, _) in COMMANDS.items() if _module_exists(target)]

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module_name, attr = COMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _module_exists(target: str) -> bool:
    """Whether a command's module is present, checked without importing it."""
    import importlib.util

    return importlib.util.find_spec(target.split(":")[0]) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dstk")
def cli():
    """dstk: DeepSpeed configs, pipelines and plans that agree with each other.

    \b
    dstk generate-config --strategy hybrid --world-size 8 --pp 4 --mbs 2 --gbs 64 -o ds.json
    dstk validate ds.json --world-size 8
    """


@contextlib.contextmanager
def _stdout_for_json(active: bool):
    """Under --json nothing but the JSON reaches stdout: while the command runs, whatever else prints
    (`import deepspeed`'s accelerator line, a C library) goes to stderr, file descriptor 1 included.
    Yields the stream the JSON goes to (echo_json)."""
    out = sys.stdout
    if not active:
        yield out
        return
    try:
        real_fd = out.fileno() == 1
    except (AttributeError, ValueError, io.UnsupportedOperation):  # a stream in memory (CliRunner)
        real_fd = False
    out.flush()
    saved = os.dup(1)
    if real_fd:
        out = open(os.dup(saved), "w", encoding=sys.stdout.encoding or "utf-8", errors="replace")
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)
        if real_fd:
            out.close()


def echo_json(data, indent: int = 2) -> None:
    """Print a command's --json result: the one thing on stdout."""
    import json  # here: `dstk --help` imports no more than it needs

    ctx = click.get_current_context()
    click.echo(json.dumps(data, indent=indent), file=(ctx.obj or {}).get("stdout", sys.stdout))


def trust_checkpoints(on: bool) -> None:
    """--trust-checkpoint of export and reshard: this process loads checkpoints as pickles, and says so first."""
    from toolkit.checkpoint import safe_load  # (imports no torch until a file is loaded)

    safe_load.trust(on)
    if on:
        click.echo("note: --trust-checkpoint: the checkpoint's .pt files are loaded as pickles (torch.load "
                   "weights_only=False), unchecked: any code in them runs", err=True)


def main(argv=None):
    """Console entry point: library errors become one line on stderr and an exit code. Under a
    launcher every rank reaches the same refusal: only rank 0 prints it, every rank exits with it."""
    from toolkit.distributed.process_group import env_rank

    loud = env_rank() == 0
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with _stdout_for_json("--json" in args) as out:
            rv = cli.main(args=args, prog_name="dstk", standalone_mode=False, obj={"stdout": out})
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        if loud:
            exc.show()
        sys.exit(exc.exit_code)
    except ConfigError as exc:  # UnusableInput included; `every_rank`: a refusal only some ranks reach
        if loud or getattr(exc, "every_rank", False):
            click.echo(f"{getattr(exc, 'severity', 'error')}: {exc}", err=True)
        sys.exit(getattr(exc, "exit_code", 2 if isinstance(exc, UnusableInput) else 1))
    sys.exit(rv if isinstance(rv, int) else 0)
