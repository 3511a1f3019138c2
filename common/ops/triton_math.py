"""Math functions shared by our Triton kernels.

On the GPU they are libdevice's, the functions torch's CUDA kernels call, so fused kernels match
the torch reference to the last bit or nearly. Under ``TRITON_INTERPRET=1`` (kernels run on CPU
tensors, for stepping through them without a GPU) libdevice does not exist and triton's own
functions stand in.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["INTERPRET", "LIBDEVICE", "exp", "log1p", "rsqrt", "cos_sin"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LIBDEVICE = tl.constexpr(not INTERPRET)


@triton.jit
def exp(v):
    if LIBDEVICE:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def rsqrt(v):
    if LIBDEVICE:
        return libdevice.rsqrt(v)
    else:
        return tl.rsqrt(v)


@triton.jit
def log1p(u):
    if LIBDEVICE:
        return libdevice.log1p(u)
    else:
        # log(1 + u) * u / ((1 + u) - 1) cancels the rounding of 1 + u (accurate for tiny u)
        w = 1.0 + u
        return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def cos_sin(angle):
    """cos and sin of fp32 angles (RoPE)."""
    if LIBDEVICE:
        return libdevice.cos(angle), libdevice.sin(angle)
    else:
        return tl.cos(angle), tl.sin(angle)
