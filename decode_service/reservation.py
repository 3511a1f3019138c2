"""Room held on a decode worker for one arriving handoff, with the bytes landing in the pools.

A reservation owns KV pages and a GDN state slot from the header (sent before the prompt is
prefilled) until the request is admitted or the handoff fails. Chunk bytes are written straight
into those pages and that slot, on a writer thread and (on a GPU) on a copy stream of its own:
nothing else reads or writes them until admission, which orders the engine's stream after the
copies. Allocation and freeing (bookkeeping) stay on the engine thread.

Payload layouts (``common/handoff/manifest.py``): ``kv [L, 2, pages, page, kv_heads, head_dim]``
against the pool's ``[L, pool_pages, 2, page, kv_heads, head_dim]``; ``conv_state`` and
``ssm_state`` one slot of ``[L, slots, ...]``; ``dflash_context`` laid out like ``kv`` in the
draft's pool.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from common.handoff.layout import to_dtype
from common.handoff.parts import HeaderPart
from common.handoff.reservation import host_bytes, write_bytes


def write_paged(pool: torch.Tensor, layer: int, page_ids: list[int], num_pages: int,
                offset: int, data: bytes | memoryview) -> None:
    """Land bytes ``[offset, offset + len(data))`` of one layer of a ``[2, num_pages, page, ...]``
    payload field in the pool ``[L, pool_pages, 2, page, ...]`` at the request's ``page_ids``.

    Whole pages go in one scatter per call; a range that starts or ends inside a page (only a
    sender that splits oddly makes one) is written page piece by page piece."""
    page_shape = pool.shape[3:]
    page_bytes = pool[0, 0, 0].numel() * pool.element_size()
    half_bytes = num_pages * page_bytes
    view = memoryview(data)
    pos = offset
    while len(view):
        half, within = divmod(pos, half_bytes)
        page, intra = divmod(within, page_bytes)
        if intra == 0 and len(view) >= page_bytes:
            count = min(len(view) // page_bytes, num_pages - page)
            n = count * page_bytes
            src = host_bytes(view[:n]).view(pool.dtype).view(count, *page_shape)
            index = torch.tensor(page_ids[page:page + count], device=pool.device)
            pool[layer, index, half] = src.to(pool.device, non_blocking=True)
        else:
            n = min(page_bytes - intra, len(view))
            write_bytes(pool[layer, page_ids[page], half], intra, view[:n])
        view = view[n:]
        pos += n


class PoolReservation:
    """Pages and a state slot held for one handoff; implements ``Reservation``.

    ``free(page_ids, slot)`` gives the room back (the engine queues it onto its thread);
    ``release`` is idempotent and loses to an admission that already took the room. ``after``
    (a GPU) marks the engine's stream at reservation: copies wait for it.
    """

    def __init__(self, header: HeaderPart, page_ids: list[int], slot: int, *,
                 kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 draft_kv: torch.Tensor | None, free: Callable[[list[int], int], None],
                 after: torch.cuda.Event | None = None) -> None:
        self.header = header
        self.page_ids = page_ids
        self.slot = slot
        self._kv, self._conv, self._ssm, self._draft_kv = kv, conv, ssm, draft_kv
        self._free = free
        on_gpu = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if on_gpu else None
        if self._stream is not None and after is not None:
            # the pages' previous owner may still have kernels queued that write them
            self._stream.wait_event(after)
        self.copied: torch.cuda.Event | None = None  # set by commit on a GPU
        # fields with no home in the pools (logprobs, top_k) wait in host memory
        self.extras = {name: torch.empty(spec.shape, dtype=to_dtype(spec.dtype))
                       for name, spec in header.manifest.items()
                       if name not in ("kv", "conv_state", "ssm_state", "dflash_context")}
        self.owned = True  # False once admitted (the request owns the room) or released
        # NOTE: admission (engine thread) and release (a cancelled handler) can race; whoever
        # takes ownership first under this lock wins, so pages never have two owners.
        self.lock = threading.Lock()

    @property
    def has_draft_context(self) -> bool:
        """The draft's context K/V of the prompt arrives in this worker's draft pool."""
        return self._draft_kv is not None and "dflash_context" in self.header.manifest

    def write(self, field: str, layer: int, offset: int, data: bytes | memoryview) -> None:
        if self._stream is None:
            self._write(field, layer, offset, data)
            return
        with torch.cuda.stream(self._stream):
            self._write(field, layer, offset, data)

    def _write(self, field: str, layer: int, offset: int, data: bytes | memoryview) -> None:
        num_pages = self.header.layout.num_pages(self.header.prompt_len)
        if field == "kv":
            write_paged(self._kv, layer, self.page_ids, num_pages, offset, data)
        elif field == "conv_state":
            write_bytes(self._conv[layer, self.slot], offset, data)
        elif field == "ssm_state":
            write_bytes(self._ssm[layer, self.slot], offset, data)
        elif field == "dflash_context":
            if self._draft_kv is not None:  # without a draft here the context is not needed
                write_paged(self._draft_kv, layer, self.page_ids, num_pages, offset, data)
        else:
            write_bytes(self.extras[field][layer], offset, data)

    def commit(self) -> None:
        """Every byte is written: mark where the copies end, for admission to wait on."""
        if self._stream is not None:
            self.copied = torch.cuda.Event()
            self.copied.record(self._stream)

    def release(self) -> None:
        with self.lock:
            if not self.owned:
                return
            self.owned = False
        if self._stream is not None:
            self._stream.synchronize()  # no copy of ours may land in the next owner's pages
        self._free(self.page_ids, self.slot)
        self.extras = {}
