"""Loss-curve PNGs."""

from __future__ import annotations

from common.training.curves import plot_curves, smooth


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([], 3) == []


def test_plot_writes_a_png(tmp_path):
    path = plot_curves(tmp_path / "sub" / "loss.png", title="t",
                       series={"train": ([1, 2, 3], [3.0, 2.0, 1.5]), "eval": ([3], [1.7])})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
