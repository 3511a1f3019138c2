"""Progress bars: drawn on a terminal only, and never with FLASHSPLIT_NO_PROGRESS set."""

from __future__ import annotations

import sys

import pytest

from common.progress import NO_PROGRESS_ENV, progress_bar, progress_enabled


def on_a_terminal(monkeypatch) -> None:
    """Make the test's stderr say it is a terminal (inside the test: capsys swaps stderr in
    when the test starts, after its fixtures)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.delenv(NO_PROGRESS_ENV, raising=False)


def test_a_bar_is_drawn_on_a_terminal(monkeypatch, capsys):
    on_a_terminal(monkeypatch)
    with progress_bar(3, "Loading weights", "tensor") as bar:
        for _ in range(3):
            bar.update()
    assert "Loading weights" in capsys.readouterr().err


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with progress_bar(3, "Loading weights", "tensor") as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
    assert not progress_enabled()


@pytest.mark.parametrize("value, drawn", [("1", False), ("yes", False), ("0", True), ("", True)])
def test_the_environment_turns_bars_off(monkeypatch, value, drawn):
    on_a_terminal(monkeypatch)
    monkeypatch.setenv(NO_PROGRESS_ENV, value)
    assert progress_enabled() is drawn


def test_a_bar_not_asked_for_is_never_drawn(monkeypatch, capsys):
    on_a_terminal(monkeypatch)
    with progress_bar(2, "Capturing decode graphs", "graph", enabled=False) as bar:
        bar.update(2)
    assert capsys.readouterr().err == ""
