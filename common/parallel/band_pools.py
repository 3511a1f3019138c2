"""A band's bytes read out of one rank's pools, and landed in another rank's.

A rank's pools hold only its heads (``kv [L, pool_pages, 2, page, kv_heads_held, head_dim]``,
``conv [L, slots, channels_held, W]``, ``ssm [L, slots, value_heads_held, ...]``), and a band
(``common/handoff/bands.py``) is a range of the full model's split dim, so ``local_start``
says where it sits in a pool. A band's layer bytes are laid out as the payload lays out its
field, narrowed to the band: for ``kv`` ``[2, pages, page, width, head_dim]`` (K of every
page, then V), so pages ``[a, b)`` of one layer are two byte runs, at ``a`` and at
``pages + a`` pages of ``page · width · head_dim`` elements.
"""

from __future__ import annotations

import torch

from common.handoff.bands import Band
from common.handoff.paged_writes import write_paged
from common.handoff.reservation import ChunkBytes, write_bytes


def band_page_bytes(kv_pool: torch.Tensor, band: Band) -> int:
    """Bytes of one page of one half (K or V) of a ``kv`` band."""
    return kv_pool.shape[3] * band.width * kv_pool.shape[5] * kv_pool.element_size()


def read_kv_band(kv_pool: torch.Tensor, layer: int, index: torch.Tensor, at: int, band: Band,
                 tail: int) -> torch.Tensor:
    """Pages ``index`` (page ids on the pool's device) of one layer of a ``kv`` band starting
    at head ``at`` of the pool, as a contiguous ``[2, n, page, width, head_dim]``; the last
    ``tail`` token rows of the last page (an earlier owner's bytes) zeroed."""
    out = kv_pool[layer].index_select(0, index)[:, :, :, at:at + band.width]
    out = out.transpose(0, 1).contiguous()
    if tail:
        out[:, -1, out.shape[2] - tail:] = 0
    return out


def read_state_band(pool: torch.Tensor, layer: int, slot: int, at: int,
                    band: Band) -> torch.Tensor:
    """One layer of a state band (``conv_state`` or ``ssm_state``) out of slot ``slot``."""
    return pool[layer, slot].narrow(0, at, band.width).contiguous()


def write_kv_band(kv_pool: torch.Tensor, layer: int, page_ids: list[int], num_pages: int,
                  at: int, band: Band, offset: int, data: ChunkBytes) -> None:
    """Land bytes ``[offset, offset + len)`` of one layer of a ``kv`` band (payload pages
    ``page_ids`` of the request, ``num_pages`` of them) at head ``at`` of the pool: the pool
    narrowed to the band's heads takes the payload's page walk. On a GPU the copy is
    asynchronous: the receiver waits for its stream before it reuses the frame."""
    write_paged(kv_pool[:, :, :, :, at:at + band.width], layer, page_ids, num_pages, offset,
                data)


def write_state_band(pool: torch.Tensor, layer: int, slot: int, at: int, band: Band,
                     offset: int, data: ChunkBytes) -> None:
    """Land bytes of one layer of a state band in slot ``slot`` at channel (head) ``at``."""
    write_bytes(pool[layer, slot].narrow(0, at, band.width), offset, data)
