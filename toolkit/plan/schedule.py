"""The timeline of DeepSpeed's own 1F1B TrainSchedule, read from its instruction stream.

    timeline = train_timeline(pp=4, micro_batches=8)   # imports deepspeed (lazily, here)
    print(render_ascii(timeline))
    timeline.bubble                                    # 0.2727... == (p-1)/(m+p-1)

Each stage runs `TrainSchedule(micro_batches, stages, stage_id).steps()`: 2*(m+p-1) steps, each
holding at most one ForwardPass or BackwardPass (plus sends, receives, loads). Step k of every
stage is one column: DeepSpeed's steps are the units in which stages wait for each other. The
instructions name pipeline *buffers*, not micro-batches; buffers are reused cyclically
(buffer = micro-batch % num_pipe_buffers) and forwards (and backwards) run in micro-batch order, so
the n-th ForwardPass of a stage is micro-batch n, checked against the buffer id.
Idle share = idle slots / all slots, which is (p-1)/(m+p-1) when a forward and a backward take
the same time; the picture does not scale backward to 2x forward.
"""

import os
from dataclasses import dataclass

from toolkit.errors import ConfigError

def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle share of a 1F1B step: (p-1)/(m+p-1)."""
    return (pp - 1) / (micro_batches + pp - 1)


IDLE = None  # a slot where the stage computes nothing
MAX_SLOTS = 2**20  # stages x steps: more than a picture can show (and minutes of DeepSpeed's generators)


@dataclass(frozen=True)
class Timeline:
    pp: int
    micro_batches: int
    rows: list  # rows[stage][step] = ("F" | "B", micro_batch) or IDLE
    buffers: list  # num_pipe_buffers() per stage: micro-batches whose activations it keeps

    @property
    def steps(self) -> int:
        return len(self.rows[0])

    @property
    def bubble(self) -> float:
        """Idle slots over all slots of all stages."""
        slots = self.pp * self.steps
        return sum(cell is IDLE for row in self.rows for cell in row) / slots

    @property
    def expected_bubble(self) -> float:
        return bubble_fraction(self.pp, self.micro_batches)

    def to_dict(self) -> dict:
        return {"pp": self.pp, "micro_batches": self.micro_batches, "steps": self.steps,
                "bubble": self.bubble, "expected_bubble": self.expected_bubble, "buffers": self.buffers,
                "rows": [[None if c is IDLE else f"{c[0]}{c[1]}" for c in row] for row in self.rows]}


def train_timeline(pp: int, micro_batches: int) -> Timeline:
    """Run DeepSpeed's TrainSchedule for every stage and collect its compute instructions."""
    for flag, value in (("--pp", pp), ("--gas/--micro-batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    slots = pp * 2 * (micro_batches + pp - 1)
    if slots > MAX_SLOTS:
        raise ConfigError(f"--pp {pp} --gas {micro_batches} draws pp * 2 * (gas + pp - 1) = {slots} slots, more than "
                          f"a picture can show (at most {MAX_SLOTS}); the bubble is (p-1)/(m+p-1) = "
                          f"{pp - 1}/{micro_batches + pp - 1} = {bubble_fraction(pp, micro_batches):.1%}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the schedule needs no device; avoid probing for one
    from deepspeed.runtime.pipe import schedule as ds

    rows, buffers = [], []
    for stage in range(pp):
        sched = ds.TrainSchedule(micro_batches=micro_batches, stages=pp, stage_id=stage)
        rows.append(_stage_row(sched, ds))
        buffers.append(sched.num_pipe_buffers())
    return Timeline(pp, micro_batches, rows, buffers)


def _stage_row(sched, ds) -> list:
    """One cell per step: ("F"|"B", micro-batch) from the step's ForwardPass/BackwardPass, else IDLE."""
    row, done = [], {"F": 0, "B": 0}
    for step in sched.steps():
        passes = [(("F" if isinstance(c, ds.ForwardPass) else "B"), c.buffer_id) for c in step
                  if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
        if len(passes) > 1:
            raise RuntimeError(f"DeepSpeed step with {len(passes)} compute instructions: {step}")
        if not passes:
            row.append(IDLE)
            continue
        kind, buffer_id = passes[0]
        micro_batch = done[kind]
        if buffer_id != micro_batch % sched.num_pipe_buffers():
            raise RuntimeError(f"stage {sched.stage_id}: {kind} of micro-batch {micro_batch} uses buffer "
                               f"{buffer_id}, expected {micro_batch % sched.num_pipe_buffers()}")
        done[kind] += 1
        row.append((kind, micro_batch))
    return row


def render_ascii(t: Timeline, width: int = 0) -> str:
    """Rows `stage s | F0 F1 B0 ...` with '.' for idle slots, then the bubble line."""
    cell = max(3, len(str(t.micro_batches - 1)) + 2) if not width else width
    lines = [f"1F1B TrainSchedule, pp={t.pp}, micro-batches={t.micro_batches}: {t.steps} steps per stage "
             f"(F = forward, B = backward, . = idle; one column per DeepSpeed step)"]
    for s, row in enumerate(t.rows):
        cells = ["." if c is IDLE else f"{c[0]}{c[1]}" for c in row]
        lines.append(f"stage {s:>2} |" + "".join(x.rjust(cell) for x in cells) + f" | buffers {t.buffers[s]}")
    lines.append(f"bubble: {t.bubble:.1%} of stage time idle; (p-1)/(m+p-1) = {t.pp - 1}/{t.micro_batches + t.pp - 1}"
                 f" = {t.expected_bubble:.1%}")
    return "\n".join(lines)


def check_png_path(path: str) -> None:
    """Refuse, before any work, a --png path that cannot take a PNG: another suffix, a missing folder."""
    if os.path.splitext(path)[1].lower() != ".png":
        raise ConfigError(f"--png {path}: the file name must end in .png (the picture is a PNG); "
                          f"e.g. --png {os.path.splitext(path)[0]}.png")
    if os.path.isdir(path):
        raise ConfigError(f"--png {path} is a directory; give a file name such as {os.path.join(path, 'schedule.png')}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"--png {path}: directory {directory} does not exist; create it first (mkdir -p {directory})")


def pyplot(path: str):
    """matplotlib.pyplot on the Agg backend, once --png `path` is checked; refused without matplotlib."""
    check_png_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png needs matplotlib, which is not installed: pip install matplotlib "
                          "(or drop --png for the ASCII picture)") from None
    return plt


def render_png(t: Timeline, path: str) -> None:
    """Draw the timeline with matplotlib (forward light, backward dark, idle blank), written
    atomically (temp file + rename): a failure leaves no half-written PNG."""
    plt = pyplot(path)
    fig, ax = plt.subplots(figsize=(max(6, t.steps * 0.35), 0.6 * t.pp + 1.2))
    colors = {"F": "#8ecae6", "B": "#219ebc"}
    for s, row in enumerate(t.rows):
        for k, c in enumerate(row):
            if c is IDLE:
                continue
            ax.broken_barh([(k, 1)], (s - 0.4, 0.8), facecolors=colors[c[0]], edgecolor="white")
            ax.text(k + 0.5, s, f"{c[0]}{c[1]}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(t.pp), [f"stage {s}" for s in range(t.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("DeepSpeed schedule step")
    ax.set_title(f"1F1B pp={t.pp} m={t.micro_batches}: bubble {t.bubble:.1%} "
                 f"(formula {t.expected_bubble:.1%})")
    fig.tight_layout()
    save_atomically(fig, path)
    plt.close(fig)


def save_atomically(fig, path: str) -> None:
    import tempfile

    from toolkit.files import as_umask

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dstk-", suffix=".png", dir=os.path.dirname(os.path.abspath(path)))
        os.close(fd)
        fig.savefig(tmp, dpi=120, format="png")
        as_umask(tmp)  # mkstemp made it 0600
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write --png {path}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
