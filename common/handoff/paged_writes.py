"""Handoff bytes landed in a paged pool: one layer's ``[2, num_pages, page, ...]`` payload field
(K of every page, then V) written at the request's pages of ``[L, pool_pages, 2, page, ...]``.

Both the whole-model landing (``decode_service/reservation.py``) and a tensor-parallel rank's
band of heads (``common/parallel/band_pools.py``, which passes the pool narrowed to its heads)
walk the bytes the same way, so they share this walk.
"""

from __future__ import annotations

import numpy as np
import torch

from common.handoff.reservation import ChunkBytes, host_bytes, write_bytes


def write_paged(pool: torch.Tensor, layer: int, page_ids: list[int], num_pages: int,
                offset: int, data: ChunkBytes) -> None:
    """Land bytes ``[offset, offset + len(data))`` of one layer of a ``[2, num_pages, page, ...]``
    payload field in ``pool`` ``[L, pool_pages, 2, page, ...]`` (a view narrowed to some heads
    too) at the request's ``page_ids``.

    Whole pages go in one scatter per call; a range that starts or ends inside a page (only a
    sender that splits oddly makes one) is written page piece by page piece. ``data`` may be a
    uint8 host tensor (see ``common.handoff.reservation``); on a GPU it crosses as bytes and is
    viewed as the pool's dtype there, so a piece at any byte offset of a pinned buffer stays one
    pinned source; the copy is asynchronous there, so the caller keeps ``data`` until its stream
    has run it."""
    page_shape = pool.shape[3:]
    page_bytes = pool[0, 0, 0].numel() * pool.element_size()
    half_bytes = num_pages * page_bytes
    src = host_bytes(data)
    start, end = 0, src.numel()
    pos = offset
    while start < end:
        half, within = divmod(pos, half_bytes)
        page, intra = divmod(within, page_bytes)
        left = end - start
        if intra == 0 and left >= page_bytes:
            count = min(left // page_bytes, num_pages - page)
            n = count * page_bytes
            rows = as_dtype(src[start:start + n].to(pool.device, non_blocking=True), pool.dtype)
            rows = rows.view(count, *page_shape)
            if pool.device.type == "cpu":
                _copy_runs(pool[layer, :, half], page_ids[page:page + count], rows)
            else:  # one scatter kernel, whatever the pages
                index = torch.tensor(page_ids[page:page + count], device=pool.device)
                pool[layer, index, half] = rows
        else:
            n = min(page_bytes - intra, left)
            target = pool[layer, page_ids[page], half]
            if target.is_contiguous():
                write_bytes(target, intra, src[start:start + n])
            else:  # a band of heads: its bytes are contiguous only in a copy
                piece = target.contiguous()
                write_bytes(piece, intra, src[start:start + n])
                target.copy_(piece)
        start += n
        pos += n


def _copy_runs(pages: torch.Tensor, page_ids: list[int], rows: torch.Tensor) -> None:
    """``pages[page_ids] = rows`` on the host as one slice copy per run of consecutive ids.

    torch's ``index_put`` on the CPU moves element by element (two bytes at a time in bf16), the
    slowest step of a landing by far; a strided slice copy runs at memory speed, numpy's about
    1.4x torch's ``copy_`` on the 2-core machine (9.0 against 6.4 GB/s, 32 KiB pages). Both views
    are taken as bytes, as numpy has no bf16."""
    dst, src = pages.view(torch.uint8).numpy(), rows.view(torch.uint8).numpy()
    first = 0
    for i in range(1, len(page_ids) + 1):
        if i == len(page_ids) or page_ids[i] != page_ids[i - 1] + 1:
            start = page_ids[first]
            np.copyto(dst[start:start + i - first], src[first:i])
            first = i


def as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D uint8 ``raw`` viewed as ``dtype`` without a copy. torch views a slice so only
    from an offset that is a multiple of the element size; other slices (a tcp frame's payload
    sits where its message's prefix ends) are viewed afresh from their first byte."""
    if raw.storage_offset() % dtype.itemsize:
        raw = host_bytes(memoryview(raw.numpy()))  # a CPU slice: the device's are fresh copies
    return raw.view(dtype)
