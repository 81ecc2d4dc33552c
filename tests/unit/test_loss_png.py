"""OUT/loss.png is optional: drawn with matplotlib where it imports, skipped with the reason where it does not (a
GPU image may lack it), never failing the run (tests/distributed/test_no_matplotlib.py: a whole run)."""

import sys

STEPS = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "eval_loss": 4.5}, {"step": 3, "loss": 3.0}]


def test_the_curve_is_drawn_where_matplotlib_imports(tmp_path):
    from toolkit.train.report import draw_loss_png

    fields = draw_loss_png(STEPS, {"eval_loss": 3.5}, tmp_path / "loss.png")
    assert fields == {"loss_png": str(tmp_path / "loss.png")}
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_nothing_is_drawn_and_the_summary_says_why(tmp_path, monkeypatch):
    from toolkit.train.report import draw_loss_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError, as if not installed
    fields = draw_loss_png(STEPS, None, tmp_path / "loss.png")
    assert fields["loss_png"] is None and not (tmp_path / "loss.png").exists()
    assert fields["loss_png_skipped"].startswith("matplotlib is not importable (ModuleNotFoundError: ")
    assert fields["loss_png_skipped"].endswith("pip install matplotlib to draw it")
