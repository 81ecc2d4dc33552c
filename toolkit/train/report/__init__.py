"""What a run reports, rank 0 for the world: progress.py (the opening block: what the run is, describe, and its
lines, start_lines; the per-step log: metrics.jsonl, a bar or plain lines, the trackers), step_stats.py (each
step's gradient norm, peak memory and pipeline stage times, gathered from every rank), memory.py (peak memory,
counted from just before the first step, the load's peak apart), footprint.py (the model-state bytes an engine
holds: parameters and their counts), trackers.py (--report-to: TensorBoard, W&B, MLflow), summary.py (the
summary's per-rank numbers and steady-state throughput, the loss table and loss.png, from OUT/metrics.jsonl)."""

from toolkit.train.report.progress import ProgressLog, StartClock, start_lines
from toolkit.train.report.summary import draw_loss_png, mfu_fields, per_rank, read_metrics, table

__all__ = ["ProgressLog", "StartClock", "start_lines", "draw_loss_png", "mfu_fields", "per_rank", "read_metrics", "table"]
