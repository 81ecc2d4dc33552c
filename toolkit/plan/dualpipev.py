"""DeepSpeed's DualPipeV instruction stream next to its 1F1B one, on one time axis, and their bubbles.

    t = timelines(pp=4, micro_batches=8)       # imports deepspeed (lazily, here)
    print(render_ascii(t))
    t["dualpipev"].bubble, t["1f1b"].bubble    # idle share of every rank's time

Each rank's compute instructions come from DeepSpeed's own generators, in their order:
`schedule.DualPipeVSchedule(m, p, r).steps()` (rank r: phase-0 stage r, phase-1 stage 2p-1-r) and
`schedule.TrainSchedule(m, p, s).steps()`. A DualPipeV step may hold a forward and a backward, so the
picture is timed, not drawn per step: every pass starts when its rank is free and its input is there
(the upstream stage's forward, the downstream stage's backward, the turn-around on the last rank), with
no transfer time. A DualPipeV stage holds half a 1F1B stage's layers: a forward costs 1 unit there and 2
in 1F1B, a backward twice its forward (weight gradients inside it: DeepSpeed 0.19.8 does not split them
out, schedule.py DualPipeVSchedule's note). The 1F1B bubble comes out as (p-1)/(m+p-1), which checks
the timing. Idle share = 1 - busy / (ranks x makespan).
"""

import os
from dataclasses import dataclass

from toolkit.errors import ConfigError

FORWARD, BACKWARD = 1, 2  # units of one DualPipeV stage's forward; backward = 2 x forward


def min_micro_batches(pp: int) -> int:
    """DualPipeVSchedule's floor: 2 micro-batches per pipeline rank."""
    return 2 * pp


@dataclass(frozen=True)
class Pass:
    kind: str  # "F" | "B"
    phase: int  # 0: out from rank 0, 1: back to rank 0 (1F1B: always 0)
    micro_batch: int
    start: int
    duration: int

    @property
    def label(self) -> str:
        return f"{self.kind if self.phase == 0 else self.kind.lower()}{self.micro_batch}"


@dataclass(frozen=True)
class Timed:
    schedule: str  # "1f1b" | "dualpipev"
    pp: int
    micro_batches: int
    rows: list  # rows[rank] = [Pass, ...] in start order

    @property
    def makespan(self) -> int:
        return max(p.start + p.duration for row in self.rows for p in row)

    @property
    def bubble(self) -> float:
        busy = sum(p.duration for row in self.rows for p in row)
        return 1 - busy / (self.pp * self.makespan)

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "pp": self.pp, "micro_batches": self.micro_batches,
                "makespan": self.makespan, "bubble": self.bubble,
                "rows": [[[p.label, p.start, p.duration] for p in row] for row in self.rows]}


def check_micro_batches(pp: int, micro_batches: int) -> None:
    need = min_micro_batches(pp)
    if micro_batches < need:
        raise ConfigError(f"--schedule dualpipev at --pp {pp} needs --gas >= 2 x pp = {need} micro-batches "
                          f"(DeepSpeed's DualPipeVSchedule), got --gas {micro_batches}; use --gas {need} or more")


def timelines(pp: int, micro_batches: int) -> dict:
    """{"1f1b": Timed, "dualpipev": Timed} for pp ranks and micro_batches per step."""
    for flag, value in (("--pp", pp), ("--gas", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    if pp < 2:
        raise ConfigError(f"--schedule dualpipev needs --pp 2 or more (two stages per pipeline rank), got --pp {pp}")
    check_micro_batches(pp, micro_batches)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the schedule needs no device; avoid probing for one
    from deepspeed.runtime.pipe import schedule as ds

    dual = [_passes(ds.DualPipeVSchedule(micro_batches, pp, r), ds, micro_batches) for r in range(pp)]
    plain = [_passes(ds.TrainSchedule(micro_batches, pp, s), ds, None) for s in range(pp)]
    return {"1f1b": Timed("1f1b", pp, micro_batches, _time(plain, _one_f1b_input, 2)),
            "dualpipev": Timed("dualpipev", pp, micro_batches, _time(dual, _dualpipev_input, 1))}


def _passes(sched, ds, phase_slots) -> list:
    """(kind, phase, micro-batch) of each ForwardPass/BackwardPass, in instruction order. DualPipeV buffers are
    phase x m + micro-batch; 1F1B's are reused cyclically, its passes run in micro-batch order."""
    found, done = [], {"F": 0, "B": 0}
    for step in sched.steps():
        for cmd in step:
            if not isinstance(cmd, (ds.ForwardPass, ds.BackwardPass)):
                continue
            kind = "F" if isinstance(cmd, ds.ForwardPass) else "B"
            if phase_slots is None:
                found.append((kind, 0, done[kind]))
                done[kind] += 1
            else:
                found.append((kind, cmd.phase, cmd.buffer_id - cmd.phase * phase_slots))
    return found


def _one_f1b_input(rank: int, pp: int, kind: str, phase: int, mb: int):
    """The pass whose end this one waits for, as (rank, kind, phase, micro-batch), or None."""
    if kind == "F":
        return (rank - 1, "F", 0, mb) if rank > 0 else None
    return (rank + 1, "B", 0, mb) if rank < pp - 1 else (rank, "F", 0, mb)


def _dualpipev_input(rank: int, pp: int, kind: str, phase: int, mb: int):
    last = pp - 1
    if kind == "F" and phase == 0:
        return (rank - 1, "F", 0, mb) if rank > 0 else None
    if kind == "F":  # phase 1: from the next rank's phase 1, or the turn-around of this rank's phase 0
        return (rank, "F", 0, mb) if rank == last else (rank + 1, "F", 1, mb)
    if phase == 1:  # the loss stage's backward follows its own forward
        return (rank, "F", 1, mb) if rank == 0 else (rank - 1, "B", 1, mb)
    return (rank, "B", 1, mb) if rank == last else (rank + 1, "B", 0, mb)


def _time(ranks: list, needs, scale: int) -> list:
    """Start every rank's passes in order as soon as the rank is free and its input has ended."""
    pp = len(ranks)
    ends, free, nxt = {}, [0] * pp, [0] * pp
    rows = [[] for _ in range(pp)]
    while any(nxt[r] < len(ranks[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while nxt[r] < len(ranks[r]):
                kind, phase, mb = ranks[r][nxt[r]]
                dep = needs(r, pp, kind, phase, mb)
                if dep is not None and dep not in ends:
                    break
                start = max(free[r], ends[dep] if dep is not None else 0)
                duration = scale * (FORWARD if kind == "F" else BACKWARD)
                rows[r].append(Pass(kind, phase, mb, start, duration))
                free[r] = ends[(r, kind, phase, mb)] = start + duration
                nxt[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"DeepSpeed's instruction streams wait on each other: ranks stop at {nxt}")
    return rows


def render_ascii(t: dict) -> str:
    """Both timelines on one time axis (3 characters a unit), each with its bubble."""
    lines = [f"pp={t['dualpipev'].pp} micro-batches={t['dualpipev'].micro_batches}; one column of 3 characters = one "
             "DualPipeV stage forward (a backward takes 2); F/B phase 0, f/b phase 1 (back towards rank 0), "
             ". idle; no transfer time"]
    for name, title in (("1f1b", "1F1B TrainSchedule (one stage per rank)"),
                        ("dualpipev", "DualPipeVSchedule (rank r: stages r and 2p-1-r)")):
        timed = t[name]
        lines.append(f"{title}: {timed.makespan} units, bubble {timed.bubble:.1%}"
                     + (f" ((p-1)/(m+p-1) = {(timed.pp - 1) / (timed.micro_batches + timed.pp - 1):.1%})"
                        if name == "1f1b" else ""))
        for r, row in enumerate(timed.rows):
            cells = ["." * 3] * timed.makespan
            for p in row:
                cells[p.start:p.start + p.duration] = [p.label.ljust(3 * p.duration, "-")[3 * k:3 * k + 3]
                                                       for k in range(p.duration)]
            lines.append(f"rank {r:>2} |" + "".join(cells) + "|")
    one, two = t["1f1b"], t["dualpipev"]
    lines.append(f"step time (compute only): dualpipev {two.makespan} / 1f1b {one.makespan} = "
                 f"{two.makespan / one.makespan:.2f}; bubble {two.bubble:.1%} vs {one.bubble:.1%}")
    return "\n".join(lines)


def render_png(t: dict, path: str) -> None:
    """Both timelines as bars on one time axis (matplotlib), written atomically."""
    from toolkit.plan.schedule import pyplot, save_atomically

    plt = pyplot(path)
    pp = t["dualpipev"].pp
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(max(8, t["1f1b"].makespan * 0.2), 1.2 * pp + 2))
    colors = {("F", 0): "#8ecae6", ("B", 0): "#219ebc", ("F", 1): "#ffb703", ("B", 1): "#fb8500"}
    for ax, name in zip(axes, ("1f1b", "dualpipev")):
        timed = t[name]
        for r, row in enumerate(timed.rows):
            for p in row:
                ax.broken_barh([(p.start, p.duration)], (r - 0.4, 0.8), facecolors=colors[(p.kind, p.phase)],
                               edgecolor="white")
                ax.text(p.start + p.duration / 2, r, p.label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
        ax.invert_yaxis()
        ax.set_title(f"{name} pp={pp} m={timed.micro_batches}: {timed.makespan} units, bubble {timed.bubble:.1%}")
    axes[-1].set_xlabel("time (units of one DualPipeV stage forward; backward = 2)")
    fig.tight_layout()
    save_atomically(fig, path)
    plt.close(fig)
