"""Refresh BENCHMARKS.md from the fragments the benchmarks write to bench/results/*.md, keeping its hand-written text.

    python bench/report.py            # rewrite BENCHMARKS.md
    python bench/report.py --check    # write nothing: print the diff; exit 1 if hand-written text would go

BENCHMARKS.md holds each fragment between `<!-- bench/results/NAME.md -->` and `<!-- end bench/results/NAME.md -->`:
that text is the fragment's and is replaced by it; everything outside these blocks is kept as it is (the opening
words, notes and histories written by hand). A fragment with no block yet gets one, after the block of the fragment
before it in ORDER (at the end if none). A section kept wholly by hand in place of its fragment says
`<!-- by hand: bench/results/NAME.md -->`: that fragment is not inserted.
"""

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ORDER = ["cli_startup", "launch_time", "partition", "wrapper_overhead", "train", "dualpipev", "expert_parallel", "lora", "plan", "data_pipeline",
         "data_throughput", "long_context", "tiled_loss", "gpu"]
INTRO = """# Benchmarks

Every figure comes from a script in `bench/` (the command is given with each table) and is also
stored as JSON in `bench/results/` with every repetition. The machines are shared and noisy, so
cases are run side by side in one process or one loop, alternating, and compared as ratios of
medians. Nothing in the test suite depends on these numbers.

`make bench` runs all of them in quick mode (`python bench/run_all.py --quick`); `--full` runs more
repetitions and larger sizes.
"""
BLOCK = re.compile(r"^<!-- bench/results/(\w+)\.md -->\n(.*?)^<!-- end bench/results/\1\.md -->\n", re.S | re.M)
OPEN = re.compile(r"^<!-- bench/results/(\w+)\.md -->$", re.M)
BY_HAND = re.compile(r"^<!-- by hand: bench/results/(\w+)\.md -->$", re.M)


def block(name: str, text: str) -> str:
    return f"<!-- bench/results/{name}.md -->\n{text}<!-- end bench/results/{name}.md -->\n"


def hand_text(doc: str) -> list:
    """The lines of `doc` outside its fragments' blocks, in order: what a refresh must keep."""
    return BLOCK.sub("", doc).splitlines()


def assemble(doc: str, fragments: dict) -> str:
    """`doc` with every block's text replaced by its fragment's (`fragments`: name -> text) and the fragments it has
    no block for, and no by-hand note of, inserted in ORDER."""
    unclosed = sorted(set(OPEN.findall(doc)) - {m.group(1) for m in BLOCK.finditer(doc)})
    if unclosed:
        raise ValueError(f"BENCHMARKS.md: no end marker for {', '.join(unclosed)}: add "
                         f"'<!-- end bench/results/NAME.md -->' after the fragment's text")
    doc = BLOCK.sub(lambda m: block(m.group(1), fragments.get(m.group(1), m.group(2))), doc)
    names = [n for n in ORDER if n in fragments] + sorted(set(fragments) - set(ORDER))
    for i, name in enumerate(names):
        if name in {m.group(1) for m in BLOCK.finditer(doc)} or name in BY_HAND.findall(doc):
            continue
        before = [m for m in BLOCK.finditer(doc) if m.group(1) in names[:i]]
        at = before[-1].end() if before else len(doc)
        doc = doc[:at] + "\n" + block(name, fragments[name]) + doc[at:]
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; print the diff; exit 1 if hand text goes")
    args = parser.parse_args()
    path = ROOT.parent / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else INTRO
    fragments = {p.stem: p.read_text() for p in sorted((ROOT / "results").glob("*.md"))}
    try:
        new = assemble(old, fragments)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    lost = [line for line in difflib.ndiff(hand_text(old), hand_text(new)) if line.startswith("- ")]
    if args.check:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "BENCHMARKS.md",
                                                   "BENCHMARKS.md, refreshed"))
        print(f"hand-written lines lost: {len(lost)}", *lost[:20], sep="\n")
        return 1 if lost else 0
    if lost:
        print(f"BENCHMARKS.md: the refresh would drop {len(lost)} hand-written line(s), e.g. {lost[0][2:]!r}; not "
              "written (python bench/report.py --check shows the diff)", file=sys.stderr)
        return 1
    path.write_text(new)
    print(f"refreshed BENCHMARKS.md from {', '.join(sorted(fragments))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
