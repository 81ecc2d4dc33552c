"""What a long data preparation is doing, for the rank that does it (the others wait, without a timeout):

    preparing --data: tokenizing train.jsonl: 120,000 / 1,600,000 rows (7.5%), 41,000 rows/s, 9.1 M tokens/s, ETA 36 s

rewritten in place about twice a second on a terminal; in a log file (stderr not a terminal) a line every
DSTK_PROGRESS_SECONDS seconds (default 30), and one when done.
"""

import os
import sys
import time

EVERY = 30.0  # seconds between lines in a log file


class Progress:
    def __init__(self, what: str, total: int, stream=None, every: float | None = None):
        self.what, self.total, self.stream = what, total, stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every = 0.5 if self.tty else float(os.environ.get("DSTK_PROGRESS_SECONDS", EVERY) if every is None
                                                  else every)
        self.start = self.last = time.monotonic()
        self.rows = self.tokens = 0

    def update(self, rows: int, tokens: int) -> None:
        """`rows` more rows read, `tokens` more tokens made."""
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._write(self.line(now))

    def line(self, now: float) -> str:
        seconds = max(now - self.start, 1e-9)
        rate = self.rows / seconds
        eta = (self.total - self.rows) / rate if rate else float("inf")
        share = f" ({100 * self.rows / self.total:.1f}%)" if self.total else ""
        return (f"{self.what}: {self.rows:,} / {self.total:,} rows{share}, {rate:,.0f} rows/s, "
                f"{self.tokens / seconds / 1e6:.2f} M tokens/s, ETA {_duration(eta)}")

    def close(self) -> None:
        seconds = time.monotonic() - self.start
        self._write(f"{self.what}: {self.rows:,} rows, {self.tokens:,} tokens in {seconds:.1f} s "
                    f"({self.rows / max(seconds, 1e-9):,.0f} rows/s)")
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str) -> None:
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s" if minutes else \
        f"{secs} s"
