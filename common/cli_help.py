"""How every flashsplit command's ``--help`` reads: each flag with its default shown."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after each flag's help, except where the default is None, False or
    empty (the help says what happens then) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if shows_no_default(action) or "default" in text:
            return text
        return super()._get_help_string(action)


def shows_no_default(action: argparse.Action) -> bool:
    """A default not worth printing: None, False (a switch), empty, or hidden."""
    d = action.default
    return (d is None or d is False or d is argparse.SUPPRESS
            or (isinstance(d, (list, tuple, str)) and not d))


def description(doc: str | None) -> str:
    """A module docstring's first paragraph, as a command's description (reST quotes off)."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(first.replace("``", "").split())
