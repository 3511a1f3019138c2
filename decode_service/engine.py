"""The decode worker's engine: admits handed-off requests into its pools and runs continuous
batching over them on its own thread. Imports no grpc.

With tensor parallelism a handoff's KV and GDN state come on per-rank streams, each rank
landing its own heads in its own pools (every rank is told at reservation, and forgets the
handoff when its room is given back, here on the engine thread, in order with the steps);
or, where the sender cannot, they land whole on this rank (a staging state per reservation)
and are scattered to every rank's pools at admission: the scatter is a collective of the
whole group, so it runs here, on the engine thread, between steps."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable

import torch

from common.cache.allocator import OutOfResources
from common.engine.errors import GroupOutOfStep, StepFailed
from common.engine.llm_engine import LLMEngine, TokenEvent
from common.engine.loop import EngineLoop
from common.cache.cache_manager import RequestTooLarge
from common.handoff.errors import HandoffError
from common.handoff.manifest import REQUIRED_FIELDS
from common.handoff.parts import HeaderPart
from common.logprobs import TokenLogprobs
from common.metrics.decode_metrics import DecodeMetrics
from common.parallel.prompt_state import PromptState
from decode_service.band_receiver import BandReceiver
from decode_service.peer_pools import SourcePools
from decode_service.reservation import PoolReservation

log = logging.getLogger(__name__)

# takes the events of one step (or one admission) together
EventSink = Callable[[list[TokenEvent]], None]


class DecodeEngine(EngineLoop):
    def __init__(self, engine: LLMEngine, sink: EventSink,
                 bands: BandReceiver | None = None) -> None:
        super().__init__("decode-engine", engine.config.cpu_threads)
        if engine.config.hold_after_prefill:
            raise ValueError("a decode engine continues requests; hold_after_prefill must be off")
        self.engine = engine
        self.sink = sink
        # the tensor-parallel followers, which take their parts of each admitted state
        self._followers = engine.runner.followers
        # rank 0's receiver of per-rank streams (None: this worker takes none)
        self._bands = bands
        self.metrics = DecodeMetrics(self.load, block_size=engine.speculator.block_size
                                     if engine.speculator is not None else None)

    # --- any thread ---
    def reserve(self, header: HeaderPart, source: SourcePools | None = None,
                rank_ticket: bytes | None = None) -> Future:
        """A future of the :class:`PoolReservation` for a handoff's header, taken on the engine
        thread; it fails with RESOURCE_EXHAUSTED (no room) or FAILED_PRECONDITION (a draft
        context this worker's draft cannot use). ``source``: the sender's pools, when the
        handoff comes as pool copies. ``rank_ticket``: its state comes on per-rank streams
        under this ticket; every rank is told to take it into the reserved pages and slot."""
        return self.call(self._reserve, header, source, rank_ticket)

    def complete_bands(self, ticket: bytes, frames: tuple[int, ...],
                       idle_timeout_s: float) -> Future:
        """Tell the followers how many frames of ``ticket`` were sent to each rank: each
        reports what landed once they have (``band_messages.landed_key``)."""
        return self.call(self._followers.complete_bands, ticket, frames, idle_timeout_s)

    @property
    def pools(self) -> SourcePools:
        """This worker's pools (what a sender's must match for pool copies)."""
        e = self.engine
        return SourcePools(e.kv_pool.kv, e.state_pool.conv, e.state_pool.ssm,
                           e.speculator.draft_pool.kv if e.speculator is not None else None)

    def admit(self, reservation: PoolReservation, first_token: int,
              first_logprobs: TokenLogprobs | None = None) -> Future:
        """Start decoding a handoff whose bytes have all landed (a future of None)."""
        return self.call(self._admit, reservation, first_token, first_logprobs)

    def abort(self, handoff_id: int) -> Future:
        return self.call(self._abort, handoff_id)

    def load(self) -> dict[str, int]:
        """A load snapshot, read from the calling thread: never waits for a step."""
        return self.engine.load()

    # --- engine thread ---
    def _reserve(self, header: HeaderPart, source: SourcePools | None,
                 rank_ticket: bytes | None = None) -> PoolReservation:
        e = self.engine
        extra = sorted(set(header.manifest) - set(REQUIRED_FIELDS) - {"dflash_context"})
        if extra:
            # nothing here consumes them yet, and their size is the header's word alone
            raise HandoffError("INVALID_ARGUMENT", f"fields {extra} are not accepted by this "
                               "decode worker")
        self._check_draft_context(header)
        # the same room, through the same owner, as a prompt scheduled here
        try:
            room = e.cache.take(e.cache.pages_for(header.prompt_len,
                                                  header.spec.sampling.max_new_tokens),
                                zero_state=False)  # the handoff's bytes overwrite the slot
        except (RequestTooLarge, OutOfResources) as exc:
            raise HandoffError("RESOURCE_EXHAUSTED", str(exc)) from None
        page_ids, slot = room.page_ids, room.slot
        speculate = e.wants_speculation(header.spec.sampling.speculative)
        after = None
        if e.kv_pool.kv.device.type == "cuda":
            after = torch.cuda.Event()
            after.record()
        staged = None
        if rank_ticket is not None:  # every rank lands its own heads
            self._expect_bands(rank_ticket, header, page_ids, slot)
        elif self._followers is not None:
            staged = PromptState.zeros_full(e.model.shard_plan, e.kv_pool, e.state_pool,
                                            e.kv_pool.pages_for(header.prompt_len))
        reservation = PoolReservation(
            header, page_ids, slot, kv=e.kv_pool.kv, conv=e.state_pool.conv,
            ssm=e.state_pool.ssm, draft_kv=e.speculator.draft_pool.kv if speculate else None,
            free=lambda ids, s: self.call(self._free_room, ids, s, rank_ticket), after=after,
            source=source, staged=staged)
        reservation.rank_ticket = rank_ticket
        return reservation

    def _expect_bands(self, ticket: bytes, header: HeaderPart, page_ids: list[int],
                      slot: int) -> None:
        pages = page_ids[:self.engine.kv_pool.pages_for(header.prompt_len)]
        page_size = self.engine.kv_pool.page_size
        self._bands.expect(ticket, pages, slot, header.prompt_len, page_size,
                           header.rank_streams)
        if self._followers is not None:
            self._followers.expect_bands(ticket, pages, slot, header.prompt_len, page_size,
                                         header.rank_streams)

    def _free_room(self, page_ids: list[int], slot: int, rank_ticket: bytes | None = None) -> None:
        if rank_ticket is not None:
            # every rank stops landing in these pages before anything else may take them
            self._bands.forget(rank_ticket)
            if self._followers is not None:
                self._followers.forget_bands(rank_ticket)
        self.engine.cache.give_back(page_ids, slot)

    def _check_draft_context(self, header: HeaderPart) -> None:
        """A draft context must fit this worker's draft exactly (the same draft on both sides),
        and a request that asks for speculative decoding must get it (FAILED_PRECONDITION)."""
        spec = header.manifest.get("dflash_context")
        speculator = self.engine.speculator
        if header.spec.sampling.speculative and (speculator is None or spec is None):
            why = ("this decode worker has no draft" if speculator is None else
                   "the prefill worker sent no draft context (it runs without one)")
            raise HandoffError(
                "FAILED_PRECONDITION",
                f"speculative decoding was asked for, but {why}: start the workers with "
                "--draft (flashsplit up --draft ...), or leave speculative unset")
        if spec is None or speculator is None:
            return  # no context, or no draft here: the request decodes without speculation
        pool = speculator.draft_pool.kv
        expected = (pool.shape[0], 2, self.engine.kv_pool.pages_for(header.prompt_len),
                    *pool.shape[3:])
        if tuple(spec.shape) != expected or spec.dtype != str(pool.dtype).removeprefix("torch."):
            raise HandoffError(
                "FAILED_PRECONDITION",
                f"dflash_context is {spec.dtype}{list(spec.shape)}, this worker's draft needs "
                f"{str(pool.dtype).removeprefix('torch.')}{list(expected)}: the prefill worker "
                "runs a different draft")

    def _admit(self, res: PoolReservation, first_token: int,
               first_logprobs: TokenLogprobs | None) -> None:
        with res.lock:
            if not res.owned:
                raise HandoffError("ABORTED", f"handoff {res.header.handoff_id} was released")
            res.owned = False  # from here the request owns its pages and slot
        h = res.header
        e = self.engine
        key = str(h.handoff_id)
        if key in e.requests:
            self._free_room(res.page_ids, res.slot)
            raise HandoffError("ALREADY_EXISTS", f"handoff {key} is already decoding")
        if res.copied is not None:
            torch.cuda.current_stream().wait_event(res.copied)  # the bytes are in the pools
        if res.staged is not None:
            self._scatter(res)
        try:
            event = e.admit_prefilled(key, list(h.spec.prompt_ids), first_token, h.spec.sampling,
                                      res.page_ids, res.slot,
                                      speculative=res.has_draft_context,
                                      first_logprobs=first_logprobs)
        except Exception:
            # the room is this call's again: free it before the caller hears of the failure
            if not e.abort(key):  # abort frees what the registered request owned
                self._free_room(res.page_ids, res.slot)
            raise
        self.metrics.admitted_request(res.has_draft_context)
        self.metrics.tokens_emitted(1)
        self._emit([event])

    def _scatter(self, res: PoolReservation) -> None:
        """Every rank's part of the staged state into its pools. A group that fails
        meanwhile cannot run another step: the engine stops, as after a failed step."""
        e = self.engine
        try:
            self._followers.scatter_state(e.model, e.kv_pool, e.state_pool,
                                          res.page_ids[:res.staged.num_pages], res.slot,
                                          res.staged)
        except GroupOutOfStep as exc:
            self._free_room(res.page_ids, res.slot)
            self.fail(exc)
            raise

    def _abort(self, handoff_id: int) -> bool:
        found = self.engine.abort(str(handoff_id))
        if found:
            self.metrics.request_ended("abort")
        return found

    def _emit(self, events: list[TokenEvent]) -> None:
        for event in events:
            if event.accept_length is not None:  # the first token of a DFLASH step
                self.metrics.spec_step(event.accept_length)
            if event.finish_reason is not None:
                self.metrics.request_ended(event.finish_reason)
        self.sink(events)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        start = time.perf_counter()
        events = self.engine.step()
        self.metrics.tokens_emitted(len(events))
        if events:
            self._emit(events)
            self.metrics.engine_step(len({event.request_id for event in events}),
                                     time.perf_counter() - start)

    def on_step_failed(self, exc: StepFailed) -> None:
        for request_id in exc.request_ids:
            self.metrics.request_ended("error")
        self.sink([TokenEvent(request_id, -1, "error") for request_id in exc.request_ids])

    def on_fatal(self, exc: BaseException) -> None:
        ended = list(self.engine.requests)
        for _ in ended:
            self.metrics.request_ended("error")
        self.sink([TokenEvent(request_id, -1, "error") for request_id in ended])
