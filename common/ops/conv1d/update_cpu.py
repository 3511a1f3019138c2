"""The in-place conv1d decode update in plain torch, fast on the CPU.

The reference (``reference.conv1d_update_in_place``) goes through the functional update: it
repeats the weight for every request, transposes the window into a copy, and scatters a clone
of the shifted window back with an index put. Here the old window is gathered once, the
shifted one is built by one flat copy and goes back with one ``index_copy_``, and the W taps are
multiplied and added in the reference's order, so output and pool are the reference's bit for
bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.conv1d.reference import check_activation, check_in_place

__all__ = ["conv1d_update_in_place"]


def conv1d_update_in_place(
    *,
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new token per request, its window read and written in the pool by slot; the
    contract of ``reference.conv1d_update_in_place`` (same arguments, same result).

    Args:
        x: [N, D] the new input of each request.
        conv_pool: [S, D, W-1] windows of one layer, updated in place; rows not named in
            ``slots`` are left untouched.
        slots: integer [N] pool rows; distinct, except that padding rows may all name slot 0.
        weight: [D, W].
        activation: "silu" or None.

    Returns:
        y: [N, D] in x.dtype.
    """
    check_activation(activation)
    width = check_in_place(x, conv_pool, slots, weight)
    n = x.shape[0]
    index = slots.to(device=conv_pool.device, dtype=torch.long)
    old = conv_pool.index_select(0, index)  # [N, D, W-1]
    # the token is stored in the pool's dtype, and the conv reads it as stored (a later step
    # sees it rounded the same way)
    token = x.to(conv_pool.dtype)
    if width > 1:
        new = torch.empty_like(old)
        # a row shifted left by one moves every channel's taps left; each channel's last tap
        # (which took the next channel's first) is then the new token
        new.view(n, -1)[:, :-1].copy_(old.view(n, -1)[:, 1:])
        new[:, :, -1].copy_(token)
        conv_pool.index_copy_(0, index, new)
    dt = (torch.float64 if torch.float64 in (x.dtype, weight.dtype, conv_pool.dtype)
          else torch.float32)
    w = weight.to(dt)
    taps = (*old.to(dt).unbind(-1), token.to(dt))
    # tap by tap from the oldest input, as the reference sums them
    y = taps[0] * w[:, 0]
    for s in range(1, width):
        y = y + taps[s] * w[:, s]
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
