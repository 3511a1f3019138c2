"""Room held on a decode worker for one arriving handoff, with the bytes landing in the pools.

A reservation owns KV pages and a GDN state slot from the header (sent before the prompt is
prefilled) until the request is admitted or the handoff fails. Chunk bytes are written straight
into those pages and that slot, on a writer thread and (on a GPU) on a copy stream of its own:
nothing else reads or writes them until admission, which orders the engine's stream after the
copies. Allocation and freeing (bookkeeping) stay on the engine thread.

Bytes land from a received buffer (the gRPC stream's ``bytes``) or from a uint8 host tensor (a
``tcp`` frame's reusable buffer, pinned on a GPU worker): from pinned memory the copy to the
device is truly asynchronous, so ``write`` records an event on the copy stream and waits for it
on the writer thread before it returns, and only then may the buffer take the next frame.

On rank 0 of a tensor-parallel worker the KV and GDN state land in a full-model staging state
instead (``staged``; its pages in order, one slot): the pools hold only this rank's heads, and
the engine scatters the staged state to every rank at admission (``decode_service/engine.py``).

Payload layouts (``common/handoff/manifest.py``): ``kv [L, 2, pages, page, kv_heads, head_dim]``
against the pool's ``[L, pool_pages, 2, page, kv_heads, head_dim]``; ``conv_state`` and
``ssm_state`` one slot of ``[L, slots, ...]``; ``dflash_context`` laid out like ``kv`` in the
draft's pool.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from common.handoff.errors import HandoffError
from common.handoff.parts import HeaderPart, PoolCopyPart
from common.handoff.paged_writes import write_paged
from common.handoff.reservation import ChunkBytes, write_bytes
from common.parallel.prompt_state import PromptState
from decode_service.peer_pools import SourcePools


class PoolReservation:
    """Pages and a state slot held for one handoff; implements ``Reservation``.

    ``free(page_ids, slot)`` gives the room back (the engine queues it onto its thread);
    ``release`` is idempotent and loses to an admission that already took the room. ``after``
    (a GPU) marks the engine's stream at reservation: copies wait for it. ``source``: the
    sender's pools, opened for the ``device`` transport (then ``copy_from`` serves).
    ``staged``: a tensor-parallel worker's full-model staging state, where ``kv``,
    ``conv_state`` and ``ssm_state`` land instead of the pools (``draft_kv`` is whole here).
    """

    def __init__(self, header: HeaderPart, page_ids: list[int], slot: int, *,
                 kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 draft_kv: torch.Tensor | None, free: Callable[[list[int], int], None],
                 after: torch.cuda.Event | None = None,
                 source: SourcePools | None = None,
                 staged: PromptState | None = None) -> None:
        self.header = header
        self.page_ids = page_ids
        self.slot = slot
        self._kv, self._conv, self._ssm, self._draft_kv = kv, conv, ssm, draft_kv
        self.staged = staged
        # per-rank streams: the ticket every rank takes this handoff's bands under (set by
        # the engine; kv, conv_state and ssm_state then never land here)
        self.rank_ticket: bytes | None = None
        # where kv, conv_state and ssm_state land: the pools, or the staging state
        self._landing = (page_ids, slot)
        if staged is not None:
            self._kv, self._conv, self._ssm = staged.kv, staged.conv, staged.ssm
            self._landing = (list(range(staged.num_pages)), 0)
        self._free = free
        self.source = source  # the sender's pools, when the handoff comes as pool copies
        self._pool_copies = False
        on_gpu = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if on_gpu else None
        if self._stream is not None and after is not None:
            # the pages' previous owner may still have kernels queued that write them
            self._stream.wait_event(after)
        self.copied: torch.cuda.Event | None = None  # set by commit on a GPU
        self.owned = True  # False once admitted (the request owns the room) or released
        # NOTE: admission (engine thread) and release (a cancelled handler) can race; whoever
        # takes ownership first under this lock wins, so pages never have two owners.
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)  # no write running
        self._writers = 0

    @property
    def has_draft_context(self) -> bool:
        """The draft's context K/V of the prompt arrives in this worker's draft pool."""
        return self._draft_kv is not None and "dflash_context" in self.header.manifest

    def write(self, field: str, layer: int, offset: int, data: ChunkBytes) -> None:
        """Land bytes (writer threads, several at once for disjoint ranges); ABORTED once the
        room was released or admitted. Returns once ``data`` may be reused: from a host
        tensor (pinned) on a GPU, once the copy stream has read it."""
        with self._writing():
            if self._stream is None:
                self._write(field, layer, offset, data)
                return
            try:
                with torch.cuda.stream(self._stream):
                    self._write(field, layer, offset, data)
            finally:
                if isinstance(data, torch.Tensor):
                    # the copies from pinned memory run after this returns; the caller hands
                    # the buffer to the next frame next. An event waits for this write's
                    # copies (and those queued before), not for other writers' later ones.
                    read = torch.cuda.Event()
                    read.record(self._stream)
                    read.synchronize()

    @contextlib.contextmanager
    def _writing(self):
        with self.lock:
            if not self.owned:
                raise HandoffError("ABORTED", "the room of this handoff was given back")
            self._writers += 1
        try:
            yield
        finally:
            with self.lock:
                self._writers -= 1
                if not self._writers:
                    self._idle.notify_all()

    def _write(self, field: str, layer: int, offset: int, data: ChunkBytes) -> None:
        num_pages = self.header.layout.num_pages(self.header.prompt_len)
        page_ids, slot = self._landing
        if field == "kv":
            write_paged(self._kv, layer, page_ids, num_pages, offset, data)
        elif field == "conv_state":
            write_bytes(self._conv[layer, slot], offset, data)
        elif field == "ssm_state":
            write_bytes(self._ssm[layer, slot], offset, data)
        elif field == "dflash_context":
            if self._draft_kv is not None:  # without a draft here the context is not needed
                write_paged(self._draft_kv, layer, self.page_ids, num_pages, offset, data)
        else:  # the engine reserves only for the fields above
            raise HandoffError("INVALID_ARGUMENT", f"field {field!r} has no place here")

    def copy_from(self, part: PoolCopyPart) -> None:
        """Run a ``device`` transport copy out of the sender's pools (``self.source``)."""
        if self.source is None:
            raise HandoffError("INVALID_ARGUMENT", "a pool copy without the sender's pools")
        self._pool_copies = True
        with self._writing():
            if self._stream is None:
                self._copy(part)
                return
            with torch.cuda.stream(self._stream):
                self._copy(part)

    def _copy(self, part: PoolCopyPart) -> None:
        src = self.source
        pools = {"kv": (src.kv, self._kv), "dflash_context": (src.draft_kv, self._draft_kv),
                 "conv_state": (src.conv, self._conv), "ssm_state": (src.ssm, self._ssm)}
        theirs, ours = pools[part.field]
        if ours is None:
            return  # a draft context this worker has no draft for
        if theirs is None:
            raise HandoffError("INVALID_ARGUMENT", f"a pool copy of {part.field!r}, but the "
                               "sender offered no such pool")
        if max(part.src_index) >= theirs.shape[1]:
            raise HandoffError("INVALID_ARGUMENT", f"pool copy of {part.field!r}: index "
                               f"{max(part.src_index)} is outside the sender's pool of "
                               f"{theirs.shape[1]}")
        if part.field in ("conv_state", "ssm_state"):
            ours[:, self.slot] = theirs[:, part.src_index[0]].to(ours.device)
            return
        end = part.dst_start + len(part.src_index)
        dst = torch.tensor(self.page_ids[part.dst_start:end], device=ours.device)
        index = torch.tensor(part.src_index, device=theirs.device)
        ours[:, dst] = theirs[:, index].to(ours.device)
        num_pages = self.header.layout.num_pages(self.header.prompt_len)
        tail = num_pages * ours.shape[3] - self.header.prompt_len
        if end == num_pages and tail:
            # as the byte stream sends them: no stale rows of the sender's earlier requests
            ours[:, self.page_ids[num_pages - 1], :, ours.shape[3] - tail:] = 0

    def commit(self) -> None:
        """Every byte is written: mark where the copies end, for admission to wait on. Pool
        copies are waited for here: the sender frees its pages once it has the ack."""
        if self._stream is not None:
            if self._pool_copies:
                self._stream.synchronize()
            self.copied = torch.cuda.Event()
            self.copied.record(self._stream)

    def release(self) -> None:
        with self.lock:
            if not self.owned:
                return
            self.owned = False
            # a write already running finishes first: its bytes must not land in the next
            # owner's pages (no new one starts now)
            self._idle.wait_for(lambda: not self._writers)
        if self._stream is not None:
            self._stream.synchronize()  # no copy of ours may land in the next owner's pages
        self._free(self.page_ids, self.slot)
