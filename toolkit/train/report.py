"""What a person reads at the end of a run: a short table of the loss curve and OUT/loss.png.

Both are made from OUT/metrics.jsonl (one JSON line per step, the summary last), so they can be
redrawn for any finished or interrupted run.
"""

import json
from pathlib import Path


def read_metrics(path) -> tuple[list, dict | None]:
    """(step records, the last summary or None) from a metrics.jsonl."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    summaries = [r["summary"] for r in records if "summary" in r]
    return [r for r in records if "step" in r], (summaries[-1] if summaries else None)


def _number(value, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else " " * (width - 1) + "-"


def table(steps: list, summary: dict | None) -> str:
    """The first step, every evaluated step and the last one: step, loss, eval loss, tokens/s."""
    lines = ["step    loss    eval  tokens/s"]
    for r in steps:
        if r is steps[-1] and summary:  # the final eval runs after the last step: it is in the summary
            r = dict(r, eval_loss=summary.get("eval_loss"))
        if r is steps[0] or r is steps[-1] or "eval_loss" in r:
            lines.append(f"{r['step']:>4}  {_number(r['loss'], 6, 3)}  {_number(r.get('eval_loss'), 6, 3)}  "
                         f"{_number(r.get('tokens_per_s'), 8, 0)}")
    if summary and summary.get("first_loss") is not None:
        evaluated = f", eval {summary['eval_loss']:.3f}" if summary.get("eval_loss") is not None else ""
        lines.append(f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}{evaluated}, "
                     f"{summary['tokens_per_s']:.0f} tokens/s, {summary['seconds']:.0f} s")
    return "\n".join(lines)


def loss_png(steps: list, summary: dict | None, path) -> Path:
    """Training loss per step (and eval loss where taken) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss", linewidth=1)
    evals = [(r["step"], r["eval_loss"]) for r in steps if r.get("eval_loss") is not None]
    if summary and summary.get("eval_loss") is not None and steps:
        evals.append((steps[-1]["step"], summary["eval_loss"]))
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
