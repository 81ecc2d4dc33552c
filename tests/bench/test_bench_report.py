"""bench/report.py refreshes BENCHMARKS.md from bench/results/*.md: a fragment's block takes its new text, a new
fragment gets a block in ORDER, and what is written by hand (outside the blocks, or a section marked by hand) stays."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402

DOC = ("# Benchmarks\n\nintro by hand\n\n" + report.block("cli_startup", "## CLI\nold figures\n")
       + "a note by hand under it\n\n<!-- by hand: bench/results/data_throughput.md -->\n## Data\nkept as written\n\n"
       + report.block("tiled_loss", "## Tiled\nold\n"))


def test_blocks_take_their_fragments_and_hand_text_stays():
    new = report.assemble(DOC, {"cli_startup": "## CLI\nnew figures\n", "data_throughput": "## Data\ngenerated\n",
                                "long_context": "## Long\nfresh\n", "tiled_loss": "## Tiled\nold\n"})
    assert "new figures" in new and "old figures" not in new
    assert "generated" not in new and "kept as written" in new  # a section kept by hand is not replaced
    assert new.index("## CLI") < new.index("## Long") < new.index("## Tiled")  # inserted after data_pipeline's rank
    assert [line for line in report.hand_text(new) if line] == [line for line in report.hand_text(DOC) if line]


def test_a_block_without_its_end_is_refused():
    with pytest.raises(ValueError, match="no end marker for cli_startup"):
        report.assemble(DOC.replace("<!-- end bench/results/cli_startup.md -->\n", ""), {})


def test_the_repositorys_benchmarks_lose_no_hand_written_line():
    """--check on BENCHMARKS.md as committed: exit 0 (no hand-written line would go), the diff printed."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "hand-written lines lost: 0" in proc.stdout
