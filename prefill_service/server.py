"""The Prefill servicer: wire format in, engine future awaited, handoff streamed to decode.

Thin by design: validation and protobuf conversion here, model work on the engine thread, the
byte stream in ``prefill_service/handoff_sender.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import convert
from common.grpc_util import abort_if_engine_stopped
from common.load_report import LoadReport
from common.sampling import stop_reason
from common.pb.flashsplit.v1 import prefill_pb2, prefill_pb2_grpc, types_pb2
from prefill_service.engine import PrefillAborted, PrefillEngine, PrefillJob
from prefill_service.handoff_sender import HandoffSender

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
        self.counters = {"handoffs_sent": 0, "handoffs_failed": 0}

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        start = time.perf_counter()
        job = await self._validate(request, context)
        if job.handoff_id in self._tasks:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"handoff {job.handoff_id} is already being prefilled")
        self._tasks[job.handoff_id] = asyncio.current_task()
        held = False
        try:
            try:
                payload = await asyncio.wrap_future(self.engine.submit(job))
            except PrefillAborted as exc:
                await context.abort(grpc.StatusCode.CANCELLED, str(exc))
            except ValueError as exc:  # e.g. a prompt larger than this worker's pool
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RuntimeError as exc:  # this request's step failed; the engine serves on
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            held = True
            prefilled = time.perf_counter()
            finished = stop_reason(payload.first_token, 1, job.params, self.eos_token_ids)
            if finished is not None:
                # nothing left to decode: skip the handoff, the router ends the request here
                return prefill_pb2.PrefillResponse(
                    handoff_id=job.handoff_id, first_token=payload.first_token,
                    prompt_len=payload.prompt_len,
                    timings=prefill_pb2.PrefillTimings(prefill_s=prefilled - start),
                    finish_reason=convert.finish_reason_to_pb(finished))
            try:
                await self.sender.send(request.decode_address, payload)
            except grpc.aio.AioRpcError as exc:
                self.counters["handoffs_failed"] += 1
                # pass decode's refusal through with its own status; unreachable -> UNAVAILABLE
                await context.abort(exc.code(), f"handoff to {request.decode_address} failed: "
                                                f"{exc.details()}")
            self.counters["handoffs_sent"] += 1
            done = time.perf_counter()
            return prefill_pb2.PrefillResponse(
                handoff_id=job.handoff_id, first_token=payload.first_token,
                prompt_len=payload.prompt_len,
                timings=prefill_pb2.PrefillTimings(prefill_s=prefilled - start,
                                                   handoff_s=done - prefilled))
        except asyncio.CancelledError:
            # the router went away or aborted: a request still in the engine must not linger
            if not held:
                self.engine.abort(job.handoff_id)
            raise
        finally:
            self._tasks.pop(job.handoff_id, None)
            if held:
                self.engine.release(job.handoff_id)

    async def _validate(self, request, context) -> PrefillJob:
        if request.handoff_id == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handoff_id must not be 0")
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        bad = [t for t in request.prompt_token_ids if t >= self.vocab_size]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token ids {bad[:5]} are outside the vocabulary "
                                f"(size {self.vocab_size})")
        if not request.decode_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is empty")
        try:
            params = convert.sampling_from_pb(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return PrefillJob(handoff_id=request.handoff_id,
                          prompt_ids=tuple(request.prompt_token_ids), params=params,
                          request_id=request.request_id,
                          speculative=convert.speculative_from_pb(request.sampling))

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
        counters = {**self.engine.counters, **self.counters}
        return convert.load_report_to_pb(LoadReport(
            kind="prefill", address=self.address, model_fingerprint=self.engine.fingerprint,
            free_pages=load["free_pages"], total_pages=load["total_pages"],
            free_slots=load["free_slots"], total_slots=load["total_slots"],
            queue_len=load["queue_len"], running=load["running"], counters=counters))
