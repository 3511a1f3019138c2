"""Progress bars on stderr for the slow parts of start-up (weight loading, CUDA graph capture).

A bar is drawn only when stderr is a terminal and ``FLASHSPLIT_NO_PROGRESS`` is unset (or "" or
"0"), so that logs stay clean: worker logs are files, ``flashsplit up`` reads its workers'
stderr through pipes, and tests capture it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from tqdm import tqdm

NO_PROGRESS_ENV = "FLASHSPLIT_NO_PROGRESS"


def progress_enabled(requested: bool = True, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a bar asked for (``requested``) is drawn."""
    if not requested or environ.get(NO_PROGRESS_ENV, "") not in ("", "0"):
        return False
    return sys.stderr.isatty()


def progress_bar(total: int, desc: str, unit: str, *, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr; a silent one (same methods, draws nothing) when not enabled or
    :func:`progress_enabled` says no."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not progress_enabled(enabled))
