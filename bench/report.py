"""Assemble BENCHMARKS.md from the fragments the benchmarks write to bench/results/*.md.

    python bench/report.py
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
ORDER = ["cli_startup", "launch_time", "partition", "wrapper_overhead", "train", "dualpipev", "lora", "plan", "data_pipeline",
         "data_throughput", "long_context", "tiled_loss", "gpu"]
INTRO = """# Benchmarks

Every figure comes from a script in `bench/` (the command is given with each table) and is also
stored as JSON in `bench/results/` with every repetition. The machines are shared and noisy, so
cases are run side by side in one process or one loop, alternating, and compared as ratios of
medians. Nothing in the test suite depends on these numbers.

`make bench` runs all of them in quick mode (`python bench/run_all.py --quick`); `--full` runs more
repetitions and larger sizes.
"""


def main():
    fragments = {p.stem: p for p in (ROOT / "results").glob("*.md")}
    names = [n for n in ORDER if n in fragments] + sorted(set(fragments) - set(ORDER))
    text = INTRO + "".join("\n" + fragments[n].read_text() for n in names)
    (ROOT.parent / "BENCHMARKS.md").write_text(text)
    print(f"wrote BENCHMARKS.md from {', '.join(names)}")


if __name__ == "__main__":
    main()
