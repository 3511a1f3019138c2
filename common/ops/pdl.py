"""Programmatic dependent launch (PDL) for our Triton kernels: a kernel starts while the one
before it in the stream is still finishing.

A batch-1 decode step is ~340 launches of a few microseconds each, and CUDA leaves about a
microsecond between two of them even inside a graph. Launched with PDL (Hopper and later), a
kernel's programs are scheduled as soon as every program of the kernel before it has signalled
(``gdc_launch_dependents``, which our PDL kernels do first thing), so they fill SMs the small
kernel before them leaves idle. Each PDL kernel then waits (``gdc_wait``) until the previous
kernel has finished and its writes are visible, before it reads anything that kernel may have
written and before it writes anything. Work that depends on nothing earlier may go before the
wait: the GEMV loads its first chunk of weights there.

Rules that keep this correct, for every kernel launched with PDL:
- wait before the first load of data another kernel produces, and before the first store;
- always wait (even a kernel with nothing to read from its predecessor), so that waiting on
  a kernel implies waiting on everything before it.

And one for callers: what a kernel reads before its wait (the GEMV's weight) must not be
written by the kernel launched just before it. Model weights are written only when a checkpoint
is loaded. The one exception is a ``FusedProjection`` moved to another device: it concatenates
its weights again on the first forward after the move, right before its GEMV, and so
synchronises the stream after that concatenation.

A kernel launched without PDL (cuBLAS, FlashInfer, torch) is ordered as usual; a PDL kernel
after it simply starts when it ends. CUDA-graph capture records the launches as programmatic
edges. These kernels are chosen as the ``triton-pdl`` backends of their ops (kernel sets
``gpu``, ``gpu-fla`` and ``gpu-triton-attention``; ``gpu-no-pdl`` leaves them out); under
``TRITON_INTERPRET=1`` or before SM90 they launch as plain kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from common.ops.triton_math import INTERPRET

__all__ = ["launch_options", "start", "trigger", "wait"]


def launch_options(pdl: bool, device: torch.device) -> dict:
    """Keyword arguments for a launch: the kernel's ``PDL`` flag and Triton's ``launch_pdl``,
    both on only where the device supports PDL (never in the interpreter)."""
    on = bool(pdl) and not INTERPRET and device.type == "cuda" \
        and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def trigger(PDL: tl.constexpr):
    """Let the next PDL kernel be scheduled once every program of this one has got here."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def start(PDL: tl.constexpr):
    """Both, for a kernel with nothing to do before reading its inputs."""
    trigger(PDL)
    wait(PDL)
