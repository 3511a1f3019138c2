"""The Prefill servicer: wire format in, engine future awaited, handoff streamed to decode.

Thin by design: validation and protobuf conversion here, model work on the engine thread, the
byte stream in ``prefill_service/handoff_stream.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import numpy as np

from common import convert
from common.grpc_util import abort_if_engine_stopped
from common.limits import request_capacity_tokens
from common.logging_setup import bind_request_id
from common.metrics.rpc_status import answered_status
from common.load_report import LoadReport
from common.sampling import stop_reason
from common.pb.flashsplit.v1 import prefill_pb2, prefill_pb2_grpc, types_pb2
from common.handoff.layout import dtype_name
from common.handoff.manifest import REQUIRED_FIELDS, FieldSpec
from common.handoff.parts import HeaderPart
from common.logprobs import TokenLogprobs
from prefill_service.engine import (FirstToken, PrefillAborted, PrefillEngine, PrefillJob,
                                    StateReady)
from prefill_service.handoff_sender import HandoffSender
from prefill_service.handoff_stream import HandoffTransportError

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: PrefillEngine, sender: HandoffSender, address: str,
                 vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.engine = engine
        self.eos_token_ids = eos_token_ids
        self.sender = sender
        self.address = address
        self.vocab_size = vocab_size
        self._tasks: dict[int, asyncio.Task] = {}
        self.metrics = engine.metrics

    @answered_status(lambda self, status: self.metrics.answered(status))
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> None:
        """Writes the first token as soon as it is sampled (when the request goes on), then
        the outcome once decode has acknowledged the handoff."""
        response = await self._run(request, context)
        await context.write(prefill_pb2.PrefillUpdate(done=response))

    async def _run(self, request: prefill_pb2.PrefillRequest, context
                   ) -> prefill_pb2.PrefillResponse:
        start = time.perf_counter()
        job = await self._validate(request, context)
        bind_request_id(job.spec.request_id)
        if job.handoff_id in self._tasks:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"handoff {job.handoff_id} is already being prefilled")
        self._tasks[job.handoff_id] = asyncio.current_task()
        try:
            return await self._prefill(job, request.decode_address, start, context)
        finally:
            self._tasks.pop(job.handoff_id, None)

    async def _prefill(self, job: PrefillJob, decode_address: str, start: float,
                       context) -> prefill_pb2.PrefillResponse:
        """Open the handoff (decode reserves room), then prefill while streaming the state."""
        handoff = self.sender.stream(decode_address, self._header(job))
        submitted = pump = None
        early: list[asyncio.Task] = []  # the first token's write, once it is sampled
        try:
            try:
                await handoff.open()
            except HandoffTransportError as exc:
                self.metrics.handoff_failed()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"handoff to {decode_address}: {exc}")
            except grpc.aio.AioRpcError as exc:
                # decode refused before anything was computed: pass its own status through
                self.metrics.handoff_failed()
                await context.abort(exc.code(), f"handoff to {decode_address} failed: "
                                                f"{exc.details()}")
            opened = time.perf_counter()
            if handoff.rank_plan is not None:  # the followers send their heads themselves
                job = dataclasses.replace(job, rank_streams=handoff.rank_plan)
            if handoff.draft_declined:  # decode decodes it without the draft: none to make
                self.metrics.draft_context_declined()
                job = _without_draft(job)
            loop = asyncio.get_running_loop()
            ready_parts: asyncio.Queue = asyncio.Queue()

            def deliver(ready: StateReady) -> None:
                if ready.final and stop_reason(ready.first_token, 1, job.spec.sampling,
                                               self.eos_token_ids) is None:
                    # the router streams this token to its client while the last layers'
                    # state is still on its way; written before the pump wakes for that state
                    early.append(asyncio.ensure_future(context.write(prefill_pb2.PrefillUpdate(
                        first_token=_first_token_pb(ready.first_token,
                                                    ready.first_logprobs)))))
                ready_parts.put_nowait(ready)

            submitted = asyncio.wrap_future(self.engine.submit(
                job, lambda ready: loop.call_soon_threadsafe(deliver, ready)))
            pump = asyncio.create_task(handoff.run(ready_parts))
            await asyncio.wait({submitted, pump}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and pump.exception() is not None:
                await self._handoff_failed(pump.exception(), decode_address, context)
            try:
                first = await submitted
            except PrefillAborted as exc:
                await context.abort(grpc.StatusCode.CANCELLED, str(exc))
            except ValueError as exc:  # e.g. a prompt larger than this worker's pool
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RuntimeError as exc:  # this request's step failed; the engine serves on
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            # the sampling step's end: this task may resume later, behind the handoff's pump
            prefilled = first.sampled_at
            timings = dict(queue_s=opened - start, prefill_s=prefilled - opened)
            finished = stop_reason(first.token_id, 1, job.spec.sampling, self.eos_token_ids)
            if finished is not None:
                # nothing left to decode: drop the handoff (decode frees its room), the router
                # ends the request here
                return _with_logprobs(prefill_pb2.PrefillResponse(
                    handoff_id=job.handoff_id, first_token=first.token_id,
                    prompt_len=job.spec.prompt_len,
                    timings=prefill_pb2.PrefillTimings(**timings),
                    finish_reason=convert.finish_reason_to_pb(finished)), first)
            await asyncio.gather(*early)  # the early token is out before the outcome
            try:
                await pump
            except Exception as exc:  # decode's status, or the stream broke on our side
                await self._handoff_failed(exc, decode_address, context)
            handoff_s = time.perf_counter() - prefilled
            self.metrics.handoff_sent(handoff.bytes_sent, handoff_s, handoff.pool_copies,
                                      handoff.over_tcp, handoff.rank_plan is not None,
                                      handoff.by_send_process)
            log.info("handoff %016x to %s: %d prompt tokens, %d bytes, acknowledged %.3f s "
                     "after the first token, %s", job.handoff_id, decode_address,
                     job.spec.prompt_len, handoff.bytes_sent, handoff_s, _path(handoff))
            return _with_logprobs(prefill_pb2.PrefillResponse(
                handoff_id=job.handoff_id, first_token=first.token_id,
                prompt_len=job.spec.prompt_len,
                timings=prefill_pb2.PrefillTimings(
                    **timings, handoff_s=handoff_s)), first)
        finally:
            for write in early:
                write.cancel()  # a no-op once written
            if pump is not None and not pump.done():
                pump.cancel()
            handoff.cancel()  # a no-op once the call ended; else decode frees its room
            if submitted is not None:
                # whatever happened, the engine holds nothing for this request afterwards
                # (abort frees a queued, running or held request alike)
                self.engine.abort(job.handoff_id)

    async def _handoff_failed(self, exc: BaseException, decode_address: str, context) -> None:
        self.metrics.handoff_failed()
        if isinstance(exc, grpc.aio.AioRpcError):
            # pass decode's refusal through with its own status; unreachable -> UNAVAILABLE
            await context.abort(exc.code(), f"handoff to {decode_address} failed: "
                                            f"{exc.details()}")
        await context.abort(grpc.StatusCode.INTERNAL, f"handoff to {decode_address} failed: "
                                                      f"{exc!r}")

    def _header(self, job: PrefillJob) -> HeaderPart:
        layout = self.engine.layout
        manifest = {name: FieldSpec(layout.field_dtype(name),
                                    layout.field_shape(name, job.spec.prompt_len))
                    for name in REQUIRED_FIELDS}
        draft_kv = self.engine.pools[3]
        asked = job.spec.sampling.speculative
        if draft_kv is not None and self.engine.engine.wants_speculation(asked):
            pages = layout.num_pages(job.spec.prompt_len)
            manifest["dflash_context"] = FieldSpec(
                dtype_name(draft_kv.dtype), (draft_kv.shape[0], 2, pages, *draft_kv.shape[3:]))
        return HeaderPart(handoff_id=job.handoff_id, fingerprint=self.engine.fingerprint,
                          layout=layout, spec=job.spec, manifest=manifest)

    async def _validate(self, request, context) -> PrefillJob:
        if request.handoff_id == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handoff_id must not be 0")
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        # through the field's buffer: a Python loop over 32k ids costs a millisecond
        ids = np.asarray(request.prompt_token_ids, dtype=np.int64)
        bad = ids[ids >= self.vocab_size]
        if bad.size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token ids {bad[:5].tolist()} are outside the vocabulary "
                                f"(size {self.vocab_size})")
        if not request.decode_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is empty")
        capacity = request_capacity_tokens(self.engine.engine)
        if len(request.prompt_token_ids) > capacity:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt of {len(request.prompt_token_ids)} tokens; this "
                                f"worker's pool holds at most {capacity}")
        try:
            spec = convert.request_spec_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return PrefillJob(handoff_id=request.handoff_id, spec=spec)

    async def Abort(self, request: types_pb2.AbortRequest, context) -> types_pb2.AbortResponse:
        found = await asyncio.wrap_future(self.engine.abort(request.handoff_id))
        task = self._tasks.get(request.handoff_id)
        if task is not None:
            task.cancel()  # a handoff in flight: cancelling it tells decode to free its room
            found = True
        log.info("abort handoff %d (%s): found=%s", request.handoff_id, request.reason, found)
        return types_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> types_pb2.LoadReport:
        await abort_if_engine_stopped(self.engine, context)
        load = self.engine.load()
        counters = self.metrics.load_counters()
        return convert.load_report_to_pb(LoadReport(
            kind="prefill", address=self.address, model_fingerprint=self.engine.fingerprint,
            free_pages=load["free_pages"], total_pages=load["total_pages"],
            free_slots=load["free_slots"], total_slots=load["total_slots"],
            queue_len=load["queue_len"], running=load["running"], counters=counters,
            max_request_tokens=request_capacity_tokens(self.engine.engine)))


def _without_draft(job: PrefillJob) -> PrefillJob:
    """``job`` prefilled without speculation, so that its draft context is not computed."""
    sampling = dataclasses.replace(job.spec.sampling, speculative=False)
    return dataclasses.replace(job, spec=dataclasses.replace(job.spec, sampling=sampling))


def _with_logprobs(response: prefill_pb2.PrefillResponse,
                   first: FirstToken) -> prefill_pb2.PrefillResponse:
    if first.logprobs is not None:
        response.first_token_logprobs.CopyFrom(convert.logprobs_to_pb(first.logprobs))
    return response


def _first_token_pb(token_id: int, logprobs: TokenLogprobs | None) -> prefill_pb2.FirstToken:
    msg = prefill_pb2.FirstToken(token_id=token_id)
    if logprobs is not None:
        msg.logprobs.CopyFrom(convert.logprobs_to_pb(logprobs))
    return msg


def _path(handoff) -> str:
    """Which way a handoff's state went, for its log line."""
    plan = handoff.rank_plan
    if plan is not None:
        return f"over per-rank streams ({plan.src_tp} -> {plan.dst_tp} ranks)"
    if handoff.by_send_process:
        return "through this worker's rank 0, written by its send process"
    return "through this worker's rank 0"
