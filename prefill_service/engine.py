"""The prefill worker's engine: batches prompts, prefills them (in chunks), samples the first
token and gathers each request's state for handoff. Runs on its own thread; imports no grpc."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from common.engine.llm_engine import LLMEngine
from common.engine.errors import StepFailed
from common.engine.loop import EngineLoop, resolve
from common.handoff.layout import LayoutDescriptor
from common.handoff.payload import HandoffPayload
from common.handoff.pools import gather_prompt_state
from common.sampling import SamplingParams

log = logging.getLogger(__name__)


class PrefillAborted(Exception):
    """The request was aborted before its prefill finished."""


@dataclass(frozen=True)
class PrefillJob:
    handoff_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str = ""
    speculative: bool | None = None


class PrefillEngine(EngineLoop):
    """``submit`` returns a future of the request's :class:`HandoffPayload`; the request keeps
    its pages and slot until ``release`` (after the decode side acknowledged, or on failure)."""

    def __init__(self, engine: LLMEngine, layout: LayoutDescriptor, fingerprint: str) -> None:
        super().__init__("prefill-engine")
        if not engine.config.hold_after_prefill:
            raise ValueError("a prefill engine needs hold_after_prefill=True")
        self.engine = engine
        self.layout = layout
        self.fingerprint = fingerprint
        self._jobs: dict[str, tuple[PrefillJob, Future]] = {}
        self.counters = {"prefilled": 0, "prompt_tokens": 0, "aborted": 0}

    # --- called from any thread ---
    def submit(self, job: PrefillJob) -> Future:
        result: Future = Future()
        self.call(self._add, job, result).add_done_callback(
            lambda f: f.exception() is not None and resolve(result, error=f.exception()))
        return result

    def release(self, handoff_id: int) -> Future:
        return self.call(self.engine.release, str(handoff_id))

    def abort(self, handoff_id: int) -> Future:
        return self.call(self._abort, str(handoff_id))

    def load(self) -> dict[str, int]:
        """A load snapshot, read from the calling thread: never waits for a step."""
        return {**self.engine.load(), "queue_len": len(self._jobs)}

    # --- engine thread ---
    def _add(self, job: PrefillJob, result: Future) -> None:
        key = str(job.handoff_id)
        self.engine.add_request(list(job.prompt_ids), job.params, request_id=key,
                                speculative=job.speculative)
        self._jobs[key] = (job, result)

    def _abort(self, key: str) -> bool:
        found = self.engine.abort(key)
        entry = self._jobs.pop(key, None)
        if entry is not None:
            self.counters["aborted"] += 1
            resolve(entry[1], error=PrefillAborted(f"handoff {key} was aborted"))
        return found

    def has_work(self) -> bool:
        # held (prefilled) requests are out of the batch; they only wait for release()
        return self.engine.has_work()

    def step(self) -> None:
        for event in self.engine.step():
            job, result = self._jobs.pop(event.request_id)
            try:
                payload = self._payload(job, event.token_id)
            except Exception as exc:  # this request's gather failed: free it, serve the rest
                log.exception("handoff %d: gathering the prompt state failed", job.handoff_id)
                self.engine.release(event.request_id)
                resolve(result, error=RuntimeError(f"gathering the prompt state failed: {exc}"))
                continue
            if not resolve(result, payload):  # its caller went away meanwhile
                self.engine.release(event.request_id)

    def _payload(self, job: PrefillJob, first_token: int) -> HandoffPayload:
        req = self.engine.requests[str(job.handoff_id)]
        spec = self.engine.speculator
        fields = gather_prompt_state(
            self.engine.kv_pool, self.engine.state_pool, req.page_ids, req.slot,
            len(req.prompt_ids), spec.draft_pool if req.speculative else None)
        self.counters["prefilled"] += 1
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        return HandoffPayload(
            handoff_id=job.handoff_id, fingerprint=self.fingerprint, layout=self.layout,
            prompt_ids=tuple(job.prompt_ids), first_token=first_token,
            sampling=job.params, fields=fields, speculative=job.speculative,
            request_id=job.request_id)

    def on_step_failed(self, exc: StepFailed) -> None:
        for request_id in exc.request_ids:
            entry = self._jobs.pop(request_id, None)
            if entry is not None:
                resolve(entry[1], error=RuntimeError(f"prefill failed: {exc.__cause__!r}"))

    def on_fatal(self, exc: BaseException) -> None:
        for _, result in self._jobs.values():
            resolve(result, error=RuntimeError(f"prefill engine failed: {exc}"))
        self._jobs.clear()
