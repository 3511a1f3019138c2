"""Process lifetime: a process started by ``flashsplit up`` / ``Cluster`` ends with its parent.

The parent passes its pid in ``FLASHSPLIT_PARENT_PID``; the child asks Linux for SIGTERM when
that parent dies (PR_SET_PDEATHSIG). It is set by the child itself after start-up rather than in
a ``preexec_fn``: running Python between fork and exec in a process that uses gRPC can crash the
child (gRPC's polling threads do not survive a fork).
"""

from __future__ import annotations

import os
import signal
import sys

PARENT_PID_ENV = "FLASHSPLIT_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent_if_asked() -> None:
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):  # the parent died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
