"""Where ranks may part ways, they agree: an error that only some ranks reach ends every rank, as one line.

Ranks diverge where each reads its own inputs: its share of a stream, its stream position in a checkpoint, a
node's disk or cache. An error raised there on some ranks only would leave the others waiting in their next
collective (gloo: 10 minutes, then a traceback), or dying with "Connection closed by peer" while the error
itself, on a rank other than 0, is printed by nobody (only rank 0 prints a refusal). So each such step is a
phase that every rank runs inside `agree`:

    with agree("setting up this rank's data"):
        sampler = StreamBatches(...)

and that ends with one collective, where each rank hands over its error, if any (all_gather_object over the
patient gloo group: Python objects on the CPU, so the same under NCCL, and no timeout while a slow rank
finishes its phase). When any rank failed, every rank raises the same error (`verdict`): the first refusal's
class (UnusableInput, ConfigError) and message, with the ranks that refused when not all did ("rank 1 of 2:
..."), which rank 0 alone prints (toolkit.cli.main) and every rank exits with; a rank whose error was not a
refusal (a bug, a full disk) raises its own, traceback and all, and the others a RankFailed naming it. Each
error raised here carries `agreed = True`: every rank is raising it, so all can still meet in a shutdown
barrier, and an agreement around this one passes it on without another collective.

The rule for a phase: no collective after a point where one rank may raise. A rank that raises skips the
rest of its phase and goes to the agreement; if the others then entered a collective inside the phase, they
would wait there for it. So phases hold local work (reading files, checks); functions with collectives of
their own agree before each (once_per_node, shared_with_rank0, portable.stage). Where that cannot hold,
an error stays its rank's: a pipeline stage reading its own layers inside DeepSpeed's PipelineModule, between
its collectives (toolkit.train.engine.model_of_rank prints it on that rank), and anything once training runs.
"""

from contextlib import contextmanager

from toolkit.errors import ConfigError, RankFailed, UnusableInput

_PATIENT = {}
MORE_SHOWN = 1  # distinct refusals shown after the first one; the rest are counted


def patient_group():
    """A gloo group of the whole world whose collectives wait up to a day: where every rank waits for
    long work on one rank (rank 0 tokenizing a large corpus, clearing or staging a run folder), which
    would outlast the process group's own timeout (DeepSpeed's 10 minutes, DEEPSPEED_TIMEOUT) and abort
    the waiting ranks. Made once (new_group is itself a collective of every rank)."""
    import datetime

    import torch.distributed as tdist

    if _PATIENT.get("world") is not tdist.group.WORLD:  # none yet, or made in a process group since destroyed
        _PATIENT.update(world=tdist.group.WORLD,
                        group=tdist.new_group(backend="gloo", timeout=datetime.timedelta(hours=24)))
    return _PATIENT["group"]


@contextmanager
def agree(what: str, name_ranks: bool = True):
    """Run the block on every rank, then agree (`settle`): any rank's error is raised on every rank. `what`:
    the phase, in words ("setting up this rank's data"), for the message about another rank's failure.
    name_ranks: a refusal that not every rank reached says which did ("rank 1 of 2: ..."); False where one rank
    works for all (rank 0 writing the run's files, one rank per node preparing the data)."""
    failure = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001  every rank must reach the agreement below
        failure = exc
    settle(failure, what, name_ranks)


def settle(failure: Exception | None, what: str, name_ranks: bool = True) -> None:
    """The agreement itself: every rank calls it with its error or None; returns when no rank failed."""
    import torch.distributed as tdist

    if failure is not None and (getattr(failure, "agreed", False) or not tdist.is_initialized()):
        raise failure  # agreed already (an agreement inside this one): every rank is raising it; or nobody to tell
    if not tdist.is_initialized():
        return
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, None if failure is None else note(failure), group=patient_group())
    if all(n is None for n in every):
        return
    error = verdict(every, what, failure, name_ranks)
    error.agreed = True  # every rank raises it now
    error.every_rank = False  # so rank 0 alone prints it (toolkit.cli.main)
    if error is failure:
        raise error
    raise error from None


def note(exc: Exception) -> tuple:
    """What a rank tells the others of its error: (kind, message), kind "unusable", "refusal", "elsewhere" (its
    report of another rank's failure) or the error's class name."""
    kinds = ((RankFailed, "elsewhere"), (UnusableInput, "unusable"), (ConfigError, "refusal"))
    return next((kind for cls, kind in kinds if isinstance(exc, cls)), type(exc).__name__), str(exc)


def verdict(every: list, what: str, mine: Exception | None = None, name_ranks: bool = True) -> Exception:
    """The error this rank raises, given every rank's note (None: no error) and its own error `mine`: a rank
    whose error was no refusal raises that (its traceback is the report); the others the first refusal (its
    class; the distinct messages of the others after it), else a RankFailed naming the first failed rank."""
    failed = [(rank, kind, message) for rank, n in enumerate(every) if n is not None for kind, message in [n]]
    refusals = [f for f in failed if f[1] in ("unusable", "refusal")]
    if mine is not None and not isinstance(mine, ConfigError):
        if refusals:
            mine.add_note(f"dstk: other ranks refused too: {summary(refusals, len(every), name_ranks)}")
        return mine
    if refusals:
        line = summary(refusals, len(every), name_ranks)
        if isinstance(mine, ConfigError) and str(mine) == line:  # its own words: kept with its class
            return mine
        return (UnusableInput if refusals[0][1] == "unusable" else ConfigError)(line)
    failures = [f for f in failed if f[1] != "elsewhere"]
    if not failures:  # only reports of a failure met in an earlier agreement
        return RankFailed(failed[0][2])
    rank, kind, message = failures[0]
    return RankFailed(f"rank {rank} of {len(every)} failed while {what}: {kind}: {message} (its traceback is in "
                      f"rank {rank}'s output)")


def summary(refusals: list, world: int, name_ranks: bool = True) -> str:
    """One line for [(rank, kind, message)]: the ranks that refused when not every rank did (`name_ranks`), the
    first message, then up to MORE_SHOWN other distinct messages."""
    distinct = list(dict.fromkeys(message for _, _, message in refusals))
    line = distinct[0]
    if name_ranks and len(refusals) < world:
        line = f"rank{'s' if len(refusals) > 1 else ''} {spans([r for r, _, _ in refusals])} of {world}: {line}"
    for other in distinct[1:1 + MORE_SHOWN]:
        line += f"; also: {other}"
    if len(distinct) > 1 + MORE_SHOWN:
        line += f"; and {len(distinct) - 1 - MORE_SHOWN} more refusal(s)"
    return line


def spans(ranks: list) -> str:
    """Sorted ranks as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
