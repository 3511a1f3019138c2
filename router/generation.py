"""One request for either public API: tokenize, check, dispatch, and track the output.

The gRPC servicer (``router/server.py``) and the OpenAI-compatible HTTP API
(``router/openai_api/``) both go through ``Generation``, so they share validation, tokenization,
worker choice, stop strings and timings, and give the same tokens for the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from common.request_spec import RequestSpec
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from common.limits import check_request_id
from common.logging_setup import bind_request_id
from common.metrics.router_metrics import RouterMetrics
from router.dispatch import Dispatcher, DispatchError, Job
from router.limits import RequestLimits, WorkerCapacity, check_request_size, check_text_size
from router.requests import (Delta, OutputTracker, ServedModel, check_prompt, new_request_id,
                             with_seed)
from router.stop_strings import check_stop_strings

log = logging.getLogger(__name__)

# Longer texts are tokenized off the event loop, so one huge prompt does not stall other streams.
_TOKENIZE_INLINE_CHARS = 4096


class Generation:
    """Admits requests (``admit``) and runs them on the workers (``run``)."""

    def __init__(self, model: ServedModel, tokenizer: Tokenizer, dispatcher: Dispatcher,
                 limits: RequestLimits = RequestLimits()) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.limits = limits
        self.metrics = RouterMetrics(waiting=lambda: dispatcher.num_queued)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (ValueError when the model has no tokenizer).

        add_special_tokens=False for a rendered chat template, which wrote its own.
        """
        if len(text) <= _TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text,
                                       add_special_tokens=add_special_tokens)

    async def admit(self, prompt: str | Sequence[int], params: SamplingParams, *,
                    request_id: str = "", stop: Sequence[str] = (), arrival: float | None = None,
                    timeout_s: float | None = None) -> tuple[Job, OutputTracker]:
        """Validate and tokenize one request; ValueError says what is wrong with it.

        ``prompt`` is text (tokenized here) or token ids. An unset seed is drawn here, so a
        retried attempt samples as the first would have. ``arrival`` is a reading of the
        dispatcher's clock (now when not given); timings are measured from it.
        """
        arrival = self.dispatcher.clock() if arrival is None else arrival
        try:
            check_request_id(request_id)
        except ValueError as exc:
            log.info("[%s...] rejected: %s", request_id[:32], exc)  # not a huge id in the log
            self.metrics.rejected()
            raise
        request_id = request_id or new_request_id()
        bind_request_id(request_id)
        try:
            params = with_seed(params)
            if isinstance(prompt, str):
                check_text_size(prompt, self.limits)
            ids = await self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
            check_prompt(ids, params, self.model)
            check_request_size(ids, params, self.limits,
                               WorkerCapacity.of(self.dispatcher.registry.workers()))
            stop = check_stop_strings(stop)
        except ValueError as exc:
            log.info("[%s] rejected: %s", request_id, exc)
            self.metrics.rejected()
            raise
        job = Job(RequestSpec(request_id, tuple(ids), params), arrival=arrival,
                  deadline=None if timeout_s is None else arrival + timeout_s)
        log.info("[%s] %d prompt tokens, max_new_tokens %d", request_id, len(ids),
                 params.max_new_tokens)
        return job, OutputTracker(self.tokenizer, job.spec.prompt_ids, arrival, stop=stop)

    async def run(self, job: Job, tracker: OutputTracker) -> AsyncIterator[Delta]:
        """Yield the request's deltas; the last has finish_reason set.

        Raises ``DispatchError`` (with the status the client gets) when the workers cannot
        complete it. Callers must close this generator (``contextlib.aclosing``) when they stop
        early, so that the attempt's cleanup aborts the request on both workers. Each request
        that runs is counted in ``metrics`` once it ends, however it ends.
        """
        bind_request_id(job.spec.request_id)
        status, last = "CANCELLED", None  # what an early close (the client left) leaves
        self.metrics.running.inc()
        try:
            async with contextlib.aclosing(self._run(job, tracker)) as deltas:
                async for delta in deltas:
                    if delta.finish_reason is not None:
                        status, last = "OK", delta
                    yield delta
        except DispatchError as exc:
            status = exc.code.name
            raise
        except Exception:
            status = "INTERNAL"  # what both APIs answer for a bug
            raise
        finally:
            self.metrics.running.dec()
            t = last.timings if last is not None else None
            self.metrics.ended(
                status, last.finish_reason if last is not None else None,
                prompt_tokens=len(job.spec.prompt_ids), completion_tokens=len(tracker.token_ids),
                time_to_first_token_s=t.time_to_first_token_s if t else None,
                inter_token_latencies_s=t.inter_token_latencies_s if t else (),
                e2e_s=t.total_s if t else None)

    async def _run(self, job: Job, tracker: OutputTracker) -> AsyncIterator[Delta]:
        """:meth:`run`'s deltas, before they are counted."""
        finish = None
        async with contextlib.aclosing(self.dispatcher.run(job)) as chunks:
            async for c in chunks:
                if job.spec.sampling.logprobs is not None and len(c.logprobs) != len(c.token_ids):
                    raise DispatchError(grpc.StatusCode.INTERNAL, f"the workers sent "
                                        f"{len(c.logprobs)} log-probabilities for "
                                        f"{len(c.token_ids)} tokens")
                times = (c.prefill.queue_s, c.prefill.prefill_s, c.prefill.handoff_s) \
                    if c.prefill else None
                delta = tracker.add(c.token_ids, c.arrival, c.accept_lengths, c.finish_reason,
                                    times, c.logprobs)
                yield delta
                if delta.finish_reason is not None:
                    # Normally the last chunk anyway. After a stop string, leaving here closes
                    # the dispatcher's generator mid-stream, and its cleanup aborts the request
                    # on both workers.
                    finish = delta.finish_reason
                    break
        log.info("[%s] done (%s): %d tokens in %.3f s", job.spec.request_id, finish,
                 len(tracker.token_ids), self.dispatcher.clock() - job.arrival)
