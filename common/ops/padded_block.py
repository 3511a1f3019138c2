"""Packed sequences laid out as one padded ``[N, L]`` block (L the longest length): the layout
the CPU backends batch their requests in (``gdn/replay_cpu.py``, ``gdn/prefill_cpu.py``,
``attention/paged_cpu.py``), so that every request's tokens go through one batched product."""

from __future__ import annotations

import itertools

import torch

__all__ = ["padded", "real_tokens"]


def real_tokens(lens: list[int], device: torch.device) -> torch.Tensor:
    """Which positions of the padded ``[N, L]`` block are tokens (``True``), not padding."""
    step = torch.arange(max(lens), device=device)
    return step[None, :] < torch.tensor(lens, device=device)[:, None]


def padded(lens: list[int], device: torch.device, starts: list[int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """The packed row of each position of the padded block ``[N * L]`` (a padding position
    names row 0) and which positions are tokens ``[N, L]``; (None, None) when the packed rows
    from ``starts[0]`` on are the block already (every sequence of length L, each right after
    the one before). ``starts``: each sequence's first packed row (default: back to back from
    row 0)."""
    length = max(lens)
    if starts is None:
        starts = list(itertools.accumulate(lens[:-1], initial=0))
    if min(lens) == length and starts == list(range(starts[0], starts[0] + len(lens) * length,
                                                    length)):
        return None, None
    real = real_tokens(lens, device)
    step = torch.arange(length, device=device)
    first = torch.tensor(starts, device=device)[:, None]
    return torch.where(real, first + step, 0).flatten(), real
