"""How an engine step fails: for its own requests only, or for the whole device.

A step that raises takes down only the requests it was running (``StepFailed``): the engine ends
them with finish reason "error", frees their pages and slots, and goes on serving the rest. Only
an error that leaves the device unusable (an illegal memory access, a device-side assert: CUDA
keeps such errors sticky, so every later launch fails too) stops the engine thread, and then the
worker reports NOT_SERVING and exits so that its supervisor replaces it. So does a
tensor-parallel step that fails on rank 0 after the followers were sent it (``GroupOutOfStep``):
they are inside that step's collectives, and the ranks can never meet in the same step again.
"""

from __future__ import annotations

import torch

# Messages of CUDA errors that poison the context: every later call fails the same way.
_STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                       "misaligned address", "an illegal instruction", "CUDA error: uncorrectable")


class StepFailed(Exception):
    """A step raised; ``request_ids`` are the requests it was running, already ended with
    "error" and their cache freed. ``__cause__`` is what the step raised."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"step of {len(request_ids)} request(s) failed: "
                         f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class GroupOutOfStep(RuntimeError):
    """A tensor-parallel forward failed on rank 0 after the followers were sent it (or a
    collective failed because a follower went away): the group cannot run another step.
    ``__cause__`` is what the forward raised."""


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the device (or the process, or its tensor-parallel group) unable
    to run another step."""
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, MemoryError's kin
        return True
    if isinstance(exc, GroupOutOfStep):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _STICKY_CUDA_ERRORS)
