"""`dstk ARGS` in the pytest process, as a user's shell would run it (Click's CliRunner around the console
entry point): what tests/unit's command and refusal tests call instead of starting a process."""

import logging
import os
import sys
import traceback
import warnings
from contextlib import chdir, contextmanager
from dataclasses import dataclass

import pytest
from click.testing import CliRunner


@dataclass
class Ran:
    """What one `dstk` command left, named as subprocess.CompletedProcess names it."""

    returncode: int
    stdout: str
    stderr: str


def invoke_dstk(args, cwd=None, env=None) -> Ran:
    """`dstk ARGS` in this process, as a user's shell runs it: through the console entry point
    toolkit.cli.main (a refusal: one line and an exit code, printed by rank 0 only), stdout and stderr
    apart, `env` set for the call only (None: unset), in `cwd`. What a fresh process would print lands
    in the captured streams: an exception that escaped main as its traceback, warnings under Python's
    default filters, log records (library handlers, logging.lastResort); help is as wide as a piped
    child's. Afterwards os.environ, torch's RNG, the warning filters and the log handlers are as before.
    A command that would start or end a process group (this process's world of one, ds_world1) is
    stopped there and fails the test: it needs a process of its own (tests/commands)."""
    import toolkit.distributed.process_group

    torch = sys.modules.get("torch")
    rng = torch.get_rng_state() if torch is not None else None
    environ = dict(os.environ)
    reached = []

    def not_here(*_, **__):
        reached.append(True)
        raise RuntimeError("invoke_dstk: this command starts or ends a process group")

    try:
        with chdir(cwd or os.getcwd()), warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
            patch.setattr(toolkit.distributed.process_group, "init", not_here)
            patch.setattr(toolkit.distributed.process_group, "shutdown", not_here)
            result = CliRunner().invoke(_FreshEntry(sys.stdout, sys.stderr), [str(a) for a in args], env=env)
    finally:
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        if rng is not None:
            torch.set_rng_state(rng)
    if reached:
        pytest.fail(f"dstk {' '.join(map(str, args))} starts or ends a process group: run it in a process of its own "
                    "(tests/commands), not through invoke_dstk")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return Ran(result.exit_code, result.stdout, stderr)


class _FreshEntry:
    """toolkit.cli.main in the shape CliRunner invokes (a name, main(args, prog_name)); runs inside
    CliRunner's isolation, where sys.stdout and sys.stderr are the captured streams."""

    name = "dstk"

    def __init__(self, outer_out, outer_err):
        self.outer = (outer_out, outer_err)  # this process's streams before CliRunner swapped them

    def main(self, args, prog_name=None, **_):
        from click import formatting

        from toolkit.cli import main

        columns = int(os.environ.get("COLUMNS") or 0) or 80  # no terminal behind a child's pipe
        formatting.FORCED_WIDTH = max(min(columns, 80) - 2, 50)  # click's width there (CliRunner restores its own)
        warnings.resetwarnings()  # Python's default filters, not pytest's (the caller's catch_warnings restores)
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = _warn_to_stderr
        with _logs_to_captured_streams(*self.outer):
            return main(list(args))


def _warn_to_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _stream_handlers() -> dict:
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return {h: h.stream for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler}


@contextmanager
def _logs_to_captured_streams(outer_out, outer_err):
    """Handlers that write to this process's stdout/stderr write to the captured ones meanwhile; the root
    logger loses pytest's capture handlers (a fresh process has none: logging.lastResort prints WARNING
    and above to stderr). Afterwards each handler writes where it did before, and one made meanwhile on a
    captured stream (a library imported during the call) writes to this process's stream instead."""
    inner_out, inner_err = sys.stdout, sys.stderr
    before = _stream_handlers()
    for handler, stream in before.items():
        if stream is outer_err or stream is sys.__stderr__:
            handler.setStream(inner_err)
        elif stream is outer_out or stream is sys.__stdout__:
            handler.setStream(inner_out)
    root = logging.getLogger()
    root_handlers, root.handlers = root.handlers, []
    try:
        yield
    finally:
        root.handlers = root_handlers
        for handler, stream in _stream_handlers().items():
            if handler in before:
                handler.setStream(before[handler])
            elif stream is inner_err or stream is inner_out:
                handler.setStream(outer_err if stream is inner_err else outer_out)


def dstk(*args, cwd=None):
    return invoke_dstk(args, cwd=cwd)
