"""One request's path through the workers: choose a pair, run it, retry before the first token.

An attempt opens ``Decode.Stream`` first (decode waits for the handoff, so no token can be missed)
and calls ``Prefill.Prefill`` concurrently. The first token reaches the client from the prefill
worker as soon as it is sampled, while the state's last layers are still on their way to decode
(``DispatchConfig.first_token_from_prefill``); decode's stream, which starts with the same token,
gives the rest. Until decode's first batch has reached the router, a failure is retried on another
pair, with a new handoff id, as a request whose prompt ends with the tokens the client already has;
after it, a failure ends the request with a status, because decode has produced part of the
output.

Whatever way an attempt ends other than normal completion (failure, retry, client cancellation,
deadline), its ``finally`` cancels both calls and sends a best-effort ``Abort`` to both workers, so
neither keeps pages, slots or a queued prompt for a request nobody is waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from common.handoff.payload import new_handoff_id
from common.logprobs import TokenLogprobs
from common.request_spec import RequestSpec
from router.client import (DecodeStream, EarlyToken, PrefillCall, PrefillResult, TokenBatch,
                           WorkerCallError, WorkerClients)
from router.attempt_failures import (AttemptFailed, DispatchError, EveryDecodeFull,  # noqa: F401
                                     prefill_failure, stream_failure)
from router.policy import choose_pair
from router.registry import WorkerRegistry

log = logging.getLogger(__name__)

Code = grpc.StatusCode


@dataclass(frozen=True)
class DispatchConfig:
    """Retry and timeout settings of the dispatcher."""

    max_attempts: int = 3
    # After prefill reports the handoff acknowledged, decode's first event should follow at once;
    # a decode worker that stays silent this long is treated as failed (and the request retried).
    first_token_timeout_s: float = 30.0
    # How long the final message waits for the prefill answer (its timings) once decode is done.
    prefill_result_grace_s: float = 5.0
    # Stream the first token to the client as the prefill worker samples it, before decode has
    # the state (False: from decode's stream, once the handoff is acknowledged). A handoff that
    # fails after it is retried on another pair as a prompt that ends with that token.
    first_token_from_prefill: bool = True

    # When every decode worker is full, a request waits for room (polling every
    # queue_poll_s) up to max_queue_wait_s, within its deadline; at most max_queued wait at once.
    max_queue_wait_s: float = 30.0
    max_queued: int = 1024
    queue_poll_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.max_queue_wait_s < 0 or self.max_queued < 0 or self.queue_poll_s <= 0:
            raise ValueError("max_queue_wait_s and max_queued must be >= 0, queue_poll_s > 0")


@dataclass(frozen=True)
class Job:
    """A validated request. arrival and deadline are readings of the dispatcher's clock."""

    spec: RequestSpec
    arrival: float = 0.0
    deadline: float | None = None


@dataclass(frozen=True)
class Chunk:
    """Tokens that reached the router together. ``arrival`` is a clock reading.

    The last chunk of a request has finish_reason set and carries the prefill worker's answer
    (for its timings) when it came in time. ``logprobs``: one per token when the request asks.
    """

    token_ids: tuple[int, ...]
    arrival: float
    accept_lengths: tuple[int, ...] = ()
    finish_reason: str | None = None
    prefill: PrefillResult | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()


class Dispatcher:
    """Runs requests on (prefill, decode) pairs chosen from the registry."""

    def __init__(self, registry: WorkerRegistry, clients: WorkerClients,
                 config: DispatchConfig = DispatchConfig(),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.registry = registry
        self.clients = clients
        self.config = config
        self.clock = clock
        self._turn = 0
        self._queued = 0  # requests waiting for room on a decode worker
        self._background: set[asyncio.Task] = set()

    @property
    def num_queued(self) -> int:
        """Requests waiting for room on a decode worker now."""
        return self._queued

    def _remaining(self, job: Job) -> float | None:
        return None if job.deadline is None else job.deadline - self.clock()

    def _expired(self, job: Job) -> bool:
        return job.deadline is not None and self.clock() >= job.deadline

    async def run(self, job: Job) -> AsyncIterator[Chunk]:
        """Yield the request's chunks; raise DispatchError when it cannot be completed.

        While every decode worker is full, the request waits for room (``DispatchConfig``'s
        queue settings) instead of failing. Callers must close the generator
        (``contextlib.aclosing``) so that an abandoned request reaches its attempt's cleanup
        even when it is dropped while suspended at a yield.
        """
        queued_at = None
        emitted: list[int] = []  # tokens a failed attempt already gave the client
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._attempts(job, emitted)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                except EveryDecodeFull as full:
                    if queued_at is None:
                        if self._queued >= self.config.max_queued:
                            raise DispatchError(Code.RESOURCE_EXHAUSTED, f"every decode worker "
                                                f"is full and {self._queued} requests already "
                                                f"wait for room: {full}") from None
                        queued_at = self.clock()
                        self._queued += 1
                    await self._wait_for_room(job, queued_at, str(full))
        finally:
            if queued_at is not None:
                self._queued -= 1

    async def _wait_for_room(self, job: Job, queued_at: float, why: str) -> None:
        waited = self.clock() - queued_at
        if waited >= self.config.max_queue_wait_s:
            raise DispatchError(Code.RESOURCE_EXHAUSTED, f"every decode worker is full; waited "
                                f"{waited:.1f} s for room: {why}")
        remaining = self._remaining(job)
        if remaining is not None and remaining <= 0:
            raise DispatchError(Code.DEADLINE_EXCEEDED, "deadline exceeded while waiting for "
                                f"room on a decode worker: {why}")
        await asyncio.sleep(self.config.queue_poll_s if remaining is None
                            else min(self.config.queue_poll_s, remaining))

    async def _attempts(self, job: Job, emitted: list[int]) -> AsyncIterator[Chunk]:
        """One round over worker pairs (up to ``max_attempts``); EveryDecodeFull when each
        refusal was for lack of room. ``emitted``: the tokens the client already has from
        failed attempts (each attempt's first token, when the prefill worker sent it early);
        an attempt continues after them, and adds its own there."""
        failures: list[str] = []
        excluded: set[str] = set()
        all_full = True  # every attempt so far was refused for lack of room
        any_full = False
        all_unservable = True  # every attempt so far was refused as unservable
        any_unservable = False
        for attempt in range(1, self.config.max_attempts + 1):
            if self._expired(job):
                raise DispatchError(Code.DEADLINE_EXCEEDED, "deadline exceeded before the first "
                                    "token; tried: " + "; ".join(failures))
            self._turn += 1
            pair = choose_pair(self.registry.views(), exclude=excluded, turn=self._turn)
            if pair is None:
                failures.append(self._no_pair_reason())
                break
            prefill, decode = pair[0].address, pair[1].address
            try:
                # closed explicitly: an abandoned request runs the attempt's cleanup (the aborts)
                # now, not when the generator is garbage-collected
                async with contextlib.aclosing(self._attempt(_after(job, emitted), prefill,
                                                             decode, attempt,
                                                             emitted)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except AttemptFailed as failed:
                log.warning("[%s] attempt %d on %s -> %s failed: %s", job.spec.request_id, attempt,
                            prefill, decode, failed.message)
                failures.append(failed.message)
                all_full = all_full and bool(failed.full)
                any_full = any_full or bool(failed.full)
                all_unservable = all_unservable and failed.unservable
                any_unservable = any_unservable or failed.unservable
                excluded.update(failed.exclude)
                for address in failed.blame:
                    self.registry.mark_failed(address, failed.message)
                for address in failed.full:
                    self.registry.note_full(address)
        if any_full and all_full:  # the last entry may be "no pair left": the full excluded
            raise EveryDecodeFull("; ".join(failures))
        # workers that answered "no room" are up: say so, rather than that nothing is reachable
        code = Code.RESOURCE_EXHAUSTED if all_full and len(failures) > 1 else Code.UNAVAILABLE
        if any_unservable and all_unservable:
            # every decode worker tried said it cannot serve this request: the request must change
            code = Code.FAILED_PRECONDITION
        raise DispatchError(code, "no worker pair could serve the request: "
                            + "; ".join(failures))

    def _no_pair_reason(self) -> str:
        down = [f"{w.kind} {w.address} ({w.last_error or 'not answered yet'})"
                for w in self.registry.workers() if not w.healthy]
        reason = "no healthy prefill/decode pair left"
        return reason + (f"; down: {', '.join(down)}" if down else "")

    async def _attempt(self, job: Job, prefill: str, decode: str, attempt: int,
                       emitted: list[int]) -> AsyncIterator[Chunk]:
        handoff_id = new_handoff_id()
        log.info("[%s] attempt %d: prefill %s, decode %s, handoff %016x", job.spec.request_id,
                 attempt, prefill, decode, handoff_id)
        call = PrefillCall(handoff_id=handoff_id, spec=job.spec, decode_address=decode)
        # NOTE: the stream is opened before the prefill starts, so the decode worker has a reader
        # for the request by the time the handoff lands.
        stream = self.clients.open_stream(decode, handoff_id, self._remaining(job))
        read = asyncio.ensure_future(stream.read())  # decode's first batch
        early: asyncio.Future[EarlyToken] = asyncio.get_running_loop().create_future()

        def on_first_token(token: EarlyToken) -> None:
            if self.config.first_token_from_prefill and not early.done():
                early.set_result(token)

        prefill_task = asyncio.create_task(
            self.clients.prefill(prefill, call, self._remaining(job), on_first_token))
        release = self.registry.assign(prefill, decode)
        prefill_task.add_done_callback(lambda task: _settle(task, release))
        # until the attempt's last call (the aborts included): a worker that left DNS keeps its
        # channel while this runs
        unhold = self.registry.hold(prefill, decode)
        completed = False
        try:
            first = await self._first_batch(job, read, prefill_task, early, prefill, decode)
            if isinstance(first, EarlyToken):
                yield Chunk((first.token_id,), self.clock(),
                            logprobs=(first.logprobs,) if first.logprobs is not None else ())
                emitted.append(first.token_id)  # a retry continues after it
                first = await self._first_batch(job, read, prefill_task, None, prefill,
                                                decode)
                if isinstance(first, PrefillResult):  # the prefill worker broke its protocol
                    raise DispatchError(Code.INTERNAL, f"prefill worker {prefill} sent a first "
                                        "token to stream, then ended the request at it")
                first = (_after_early(first[0], emitted[-1], decode), first[1])
            if isinstance(first, PrefillResult):
                # The request ended at its first token; there is no handoff to stream.
                completed = True
                stream.cancel()
                yield Chunk((first.first_token,), self.clock(), (), first.finish_reason, first,
                            (first.first_logprobs,) if first.first_logprobs is not None else ())
                return
            async for chunk in self._follow(job, stream, prefill_task, decode, first,
                                            len(emitted)):
                # the caller may close this generator at the last chunk: decode has ended the
                # request by then, and neither worker holds anything to abort
                completed = chunk.finish_reason is not None
                yield chunk
            completed = True
        finally:
            read.cancel()  # a no-op once it has its batch
            if not completed:
                # Cancelled, failed or retried: free whatever either worker holds for it.
                prefill_task.cancel()
                stream.cancel()
                self._abort_later(prefill, decode, handoff_id, job.spec.request_id, then=unhold)
            else:
                unhold()

    async def _first_batch(self, job: Job, read: asyncio.Future, prefill_task: asyncio.Task,
                           early: asyncio.Future | None, prefill: str, decode: str
                           ) -> tuple[TokenBatch, float] | PrefillResult | EarlyToken:
        """Wait for the first tokens: decode's first batch (``read``, the stream's first read,
        left running when something else comes first: cancelling it would end the stream), the
        prefill worker's answer when the request ended at its first token, or (``early`` given)
        that worker's first token sent before the handoff was acknowledged. Raise AttemptFailed
        (retryable) or DispatchError."""
        await asyncio.wait({read, prefill_task} | ({early} if early is not None else set()),
                           return_when=asyncio.FIRST_COMPLETED)
        if early is not None and early.done() and not read.done():
            return early.result()
        # A dead decode worker fails its Stream and makes the prefill fail too; the stream
        # is checked first so that the decode worker, not the prefill worker, is blamed.
        if not read.done():
            exc = prefill_task.exception()
            if exc is not None:
                raise self._deadline_or(job, exc, lambda: prefill_failure(exc, prefill, decode))
            result = prefill_task.result()
            if result.finish_reason is not None:
                return result
            done, _ = await asyncio.wait({read}, timeout=self.config.first_token_timeout_s)
            if not done:
                raise AttemptFailed(f"decode worker {decode} sent no token within "
                                    f"{self.config.first_token_timeout_s} s of the handoff",
                                    blame=(decode,))
        exc = read.exception()
        if exc is not None:
            raise self._deadline_or(job, exc, lambda: stream_failure(exc, decode))
        batch: TokenBatch | None = read.result()
        if batch is None or not batch.token_ids:
            why = "ended the stream" if batch is None else \
                f"finished with {batch.finish_reason} ({batch.error or 'no message'})"
            # The worker answered, so it is not marked down; this request just moves on.
            raise AttemptFailed(f"decode worker {decode} {why} before the first token",
                                exclude=(decode,))
        return batch, self.clock()

    async def _follow(self, job: Job, stream: DecodeStream, prefill_task: asyncio.Task,
                      decode: str, first: tuple[TokenBatch, float],
                      num_tokens: int) -> AsyncIterator[Chunk]:
        """Yield the first batch and the rest of the stream; no retry is possible any more.
        ``num_tokens``: how many the client has already (for messages)."""
        batch, arrival = first
        while True:
            num_tokens += len(batch.token_ids)
            if batch.finish_reason == "error":
                if batch.token_ids:
                    yield Chunk(batch.token_ids, arrival, batch.accept_lengths,
                                logprobs=batch.logprobs)
                raise DispatchError(Code.INTERNAL, f"decode worker {decode} failed after "
                                    f"{num_tokens} tokens: {batch.error or 'no message'}")
            if batch.finish_reason is not None:
                prefill_result = await self._prefill_result(job, prefill_task)
                yield Chunk(batch.token_ids, arrival, batch.accept_lengths, batch.finish_reason,
                            prefill_result, batch.logprobs)
                return
            if batch.token_ids:  # empty: decode's first batch held only the early token
                yield Chunk(batch.token_ids, arrival, batch.accept_lengths,
                            logprobs=batch.logprobs)
            try:
                next_batch = await stream.read()
            except WorkerCallError as exc:
                if exc.code == Code.DEADLINE_EXCEEDED and self._expired(job):
                    raise DispatchError(Code.DEADLINE_EXCEEDED, f"deadline exceeded after "
                                        f"{num_tokens} tokens") from None
                self.registry.mark_failed(decode, str(exc))
                raise DispatchError(Code.UNAVAILABLE, f"decode worker {decode} failed after "
                                    f"{num_tokens} tokens: {exc.code.name}: {exc.details}") \
                    from None
            if next_batch is None:
                raise DispatchError(Code.UNAVAILABLE, f"decode worker {decode} ended the stream "
                                    f"after {num_tokens} tokens without a finish reason")
            batch, arrival = next_batch, self.clock()

    async def _prefill_result(self, job: Job, task: asyncio.Task) -> PrefillResult | None:
        """The prefill answer (only its timings are still needed), if it comes in time."""
        try:
            return await asyncio.wait_for(asyncio.shield(task),
                                          self.config.prefill_result_grace_s)
        except (asyncio.TimeoutError, WorkerCallError) as exc:
            log.warning("[%s] no prefill timings: %s", job.spec.request_id, exc)
            return None

    def _deadline_or(self, job: Job, exc: BaseException,
                     otherwise: Callable[[], Exception]) -> Exception:
        if isinstance(exc, WorkerCallError):
            if exc.code == Code.DEADLINE_EXCEEDED and self._expired(job):
                return DispatchError(Code.DEADLINE_EXCEEDED,
                                     "deadline exceeded before the first token")
            return otherwise()
        return exc  # not a worker status: a bug, surfaced as it is

    def _abort_later(self, prefill: str, decode: str, handoff_id: int, request_id: str,
                     then: Callable[[], None] = lambda: None) -> None:
        """Fire-and-forget Abort to both workers (bounded by the client's abort timeout);
        ``then`` runs once both have ended."""
        async def abort_both() -> None:
            results = await asyncio.gather(
                self.clients.abort(prefill, "prefill", handoff_id, "cancelled by the router"),
                self.clients.abort(decode, "decode", handoff_id, "cancelled by the router"),
                return_exceptions=True)
            for address, r in zip((prefill, decode), results, strict=True):
                if isinstance(r, BaseException):
                    log.info("[%s] abort on %s failed: %s", request_id, address, r)

        task = asyncio.create_task(abort_both())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda _: then())

    async def drain(self, timeout: float = 2.0) -> None:
        """Give outstanding aborts a moment to go out (at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)


def _after(job: Job, emitted: list[int]) -> Job:
    """``job`` as it goes on after the client got ``emitted``: those tokens end its prompt, and
    its budget of new tokens is that much smaller (a seeded sample's draws start again there)."""
    if not emitted:
        return job
    sampling = dataclasses.replace(job.spec.sampling,
                                   max_new_tokens=job.spec.sampling.max_new_tokens - len(emitted))
    spec = RequestSpec(job.spec.request_id, job.spec.prompt_ids + tuple(emitted), sampling)
    return dataclasses.replace(job, spec=spec)


def _after_early(batch: TokenBatch, early: int, decode: str) -> TokenBatch:
    """Decode's first batch without the first token, which the client already has from the
    prefill worker."""
    if not batch.token_ids or batch.token_ids[0] != early:
        raise DispatchError(Code.INTERNAL, f"decode worker {decode} started with token "
                            f"{batch.token_ids[:1]}, the prefill worker sampled {early}")
    return dataclasses.replace(batch, token_ids=batch.token_ids[1:], logprobs=batch.logprobs[1:])


def _settle(task: asyncio.Task, release: Callable[[], None]) -> None:
    """Uncount the assignment; mark the outcome retrieved (a retried attempt may never read it)."""
    release()
    if not task.cancelled():
        task.exception()
