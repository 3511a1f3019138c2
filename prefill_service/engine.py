"""The prefill worker's engine: batches prompts, prefills them (in chunks), samples the first
token, and reports after every step which part of each request's state is final, so that the
handoff streams it while the next chunk computes. Runs on its own thread; imports no grpc."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from common.engine.llm_engine import LLMEngine
from common.engine.errors import StepFailed
from common.engine.layer_progress import LayerProgress
from common.engine.loop import EngineLoop, resolve
from common.handoff.layout import LayoutDescriptor
from common.logprobs import TokenLogprobs
from common.metrics.prefill_metrics import PrefillMetrics
from common.parallel.prompt_state import PromptState
from common.parallel.rank_streams import RankStreamPlan
from common.request_spec import RequestSpec

log = logging.getLogger(__name__)


class PrefillAborted(Exception):
    """The request was aborted before its prefill finished."""


@dataclass(frozen=True)
class PrefillJob:
    """One prompt to prefill: the request, and the handoff that carries its state to decode
    (the engine keys the request by ``handoff_id``, so a retried attempt is a new one)."""

    handoff_id: int
    spec: RequestSpec
    # per-rank streams: every rank sends its own heads to the decode ranks (the followers
    # are told after each step); None: a tensor-parallel engine gathers them here
    rank_streams: RankStreamPlan | None = None


@dataclass(frozen=True)
class StateReady:
    """Part of a request's prompt state that is now final in the pools (the sender reads it).

    KV (and draft context) pages ``[0, num_pages)`` of ``page_ids`` are complete; once
    ``first_token`` is set the whole prompt is done, the GDN state of ``slot`` is final and
    nothing more follows. ``ready`` (a GPU) marks the end of the step that wrote it: reads wait
    for it, on a stream of their own, so the engine thread never waits for a copy.
    """

    page_ids: tuple[int, ...]
    slot: int
    num_pages: int
    speculative: bool
    first_token: int | None = None
    ready: torch.cuda.Event | None = None
    # with the first token, when the request asks for log-probabilities
    first_logprobs: TokenLogprobs | None = None
    # the progress of the step's forward, layer by layer, reported before it ran (None: the
    # step is over, read after ``ready``)
    layer_ready: LayerProgress | None = None
    # draft context pages ``[0, draft_pages)`` are final (None: as many as ``num_pages``); the
    # GDN state of ``slot`` is final (None: once ``final``)
    draft_pages: int | None = None
    states_final: bool | None = None
    # a tensor-parallel engine's report: the full model's KV of the pages this report makes
    # final (in order: page i of it is ``page_ids[gathered_from + i]``) and, in the final
    # report, its GDN state (slot 0), gathered from every rank, since each rank's pools hold
    # only its heads; read instead of the pools
    gathered: PromptState | None = None
    gathered_from: int = 0

    @property
    def final(self) -> bool:
        return self.first_token is not None

    @property
    def final_draft_pages(self) -> int:
        return self.num_pages if self.draft_pages is None else self.draft_pages

    @property
    def final_states(self) -> bool:
        return self.final if self.states_final is None else self.states_final


ReadySink = Callable[[StateReady], None]


@dataclass(frozen=True)
class FirstToken:
    """What a prefill produces: the token sampled after the prompt, and its log-probabilities
    when the request asks for them."""

    token_id: int
    # time.perf_counter() when the step that sampled it returned: the end of the prefill,
    # however late the caller's thread takes the result up
    sampled_at: float
    logprobs: TokenLogprobs | None = None


class PrefillEngine(EngineLoop):
    """``submit`` returns a future of the request's :class:`FirstToken` and reports each
    step's progress to the job's sink as :class:`StateReady` (on the engine thread: the sink
    must only hand it on). The request keeps its pages and slot until ``release`` (after the
    decode side acknowledged, or on failure).

    A job with ``rank_streams`` goes over per-rank streams instead: after each step the
    followers are told what it made final and send their own heads of it straight to the
    decode ranks (``common/parallel/band_messages.py``), and the report carries nothing
    gathered; this rank's sender sends its own part.

    Otherwise, with tensor parallelism (the engine's runner has followers) each step's report
    carries every rank's part of what it made final, gathered to this one (``gathered``): the
    KV pages the chunk completed, and after the last chunk the GDN state too. The gather is a
    collective of the whole group, so it runs here on the engine thread between steps, and
    the KV of early chunks travels while later chunks compute."""

    def __init__(self, engine: LLMEngine, layout: LayoutDescriptor, fingerprint: str) -> None:
        super().__init__("prefill-engine", engine.config.cpu_threads)
        if not engine.config.hold_after_prefill:
            raise ValueError("a prefill engine needs hold_after_prefill=True")
        self.engine = engine
        self.layout = layout
        self.fingerprint = fingerprint
        self._jobs: dict[str, tuple[PrefillJob, Future, ReadySink]] = {}
        self._reported: dict[str, int] = {}  # pages already reported per request
        # a sink that raised while a forward was queued: the request ends after that step
        self._broken: dict[str, Exception] = {}
        # requests on per-rank streams whose followers are not yet told that they ended: told
        # once whatever the end (success included), each drops what it holds and deletes its
        # report from the group's store (``prefill_service/follower_bands.py``)
        self._banded: set[str] = set()
        # the tensor-parallel followers, whose parts of a request's state are gathered here
        self._followers = engine.runner.followers
        if self._followers is None:  # sharded pools cannot be read layer by layer
            engine.on_extend = self._extend_starting
        # per request: when it was submitted, and when the first step that ran it began
        self._submitted: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self.metrics = PrefillMetrics(self.load)

    # --- called from any thread ---
    def submit(self, job: PrefillJob, sink: ReadySink = lambda ready: None) -> Future:
        result: Future = Future()
        self.call(self._add, job, result, sink, time.perf_counter()).add_done_callback(
            lambda f: f.exception() is not None and resolve(result, error=f.exception()))
        return result

    def release(self, handoff_id: int) -> Future:
        return self.call(self.engine.release, str(handoff_id))

    def abort(self, handoff_id: int) -> Future:
        return self.call(self._abort, str(handoff_id))

    def load(self) -> dict[str, int]:
        """A load snapshot, read from the calling thread: never waits for a step."""
        return {**self.engine.load(), "queue_len": len(self._jobs)}

    @property
    def pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``kv``, ``conv``, ``ssm`` and the draft's ``kv`` pool tensors (None without a draft):
        what a sender reads a :class:`StateReady` from."""
        e = self.engine
        draft = e.speculator.draft_pool.kv if e.speculator is not None else None
        return e.kv_pool.kv, e.state_pool.conv, e.state_pool.ssm, draft

    # --- engine thread ---
    def _add(self, job: PrefillJob, result: Future, sink: ReadySink, submitted: float) -> None:
        key = str(job.handoff_id)
        self.engine.add_request(list(job.spec.prompt_ids), job.spec.sampling, request_id=key)
        self._jobs[key] = (job, result, sink)
        if self._followers is not None and job.rank_streams is not None:
            self._banded.add(key)
        self._reported[key] = 0
        self._submitted[key] = submitted

    def _abort(self, key: str) -> bool:
        found = self.engine.abort(key)
        entry = self._finish(key)
        self._drop_bands(key)  # the server aborts every request once its handoff is over
        if entry is not None:
            self.metrics.prompt_aborted()
            resolve(entry[1], error=PrefillAborted(f"handoff {key} was aborted"))
        return found

    def has_work(self) -> bool:
        # held (prefilled) requests are out of the batch; they only wait for release()
        return self.engine.has_work()

    def _final_pages(self, req, cached: int) -> int:
        """Pages of ``req`` whose KV is final once ``cached`` of its prompt tokens are: all of
        the prompt's when that is the whole prompt, else the full pages (the last one fills on
        in the next chunk)."""
        page_size = self.engine.kv_pool.page_size
        if cached >= len(req.prompt_ids):
            return -(-len(req.prompt_ids) // page_size)
        return cached // page_size

    def _extend_starting(self, step, progress) -> None:
        """An EXTEND forward is about to run: report what it makes final (KV pages, and on a
        prompt's last chunk its GDN state) with its layer progress, so the handoff reads each
        layer as soon as it has run instead of after the step. The draft context and the
        first token follow from ``step``."""
        for req, n in zip(step.requests, step.num_new_tokens):
            key = req.request_id
            entry = self._jobs.get(key)
            if entry is None or key in self._broken:
                continue
            cached = req.num_cached + n
            done = cached >= len(req.prompt_ids)
            pages = self._final_pages(req, cached)
            if not done and pages == self._reported[key]:
                continue
            self._reported[key] = pages
            try:
                entry[2](StateReady(tuple(req.page_ids), req.slot, pages, req.speculative,
                                    layer_ready=progress, draft_pages=0, states_final=done))
            except Exception as exc:  # noqa: BLE001 - handled after the step, for this one only
                self._broken[key] = exc

    def step(self) -> None:
        began = time.perf_counter()
        events = {e.request_id: e for e in self.engine.step()}
        ended = time.perf_counter()
        ready = None
        if self.engine.kv_pool.kv.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for req in self.engine.last_step_requests:
            key = req.request_id
            entry = self._jobs.get(key)
            if entry is None:
                continue
            job, result, sink = entry
            started = self._started.get(key)
            if started is None:  # this step is the prompt's first
                started = self._started[key] = began
                self.metrics.prompt_started(began - self._submitted[key])
            event = events.get(key)
            first = None if event is None else FirstToken(event.token_id, ended,
                                                             event.logprobs)
            pages = self._final_pages(req, req.num_cached)
            if first is None and pages == self._reported[key] and key not in self._broken:
                continue  # this chunk completed no page (or its forward reported them)
            since, self._reported[key] = self._reported[key], pages
            # a failure here leaves the group out of step: it ends the engine, not the request
            gathered = None
            if self._followers is not None and job.rank_streams is not None:
                self._followers.send_bands(job.handoff_id, job.rank_streams,
                                           req.page_ids[since:pages], since,
                                           req.slot if first is not None else None)
            elif self._followers is not None:
                gathered = self._gather(req, since, pages, final=first is not None)
            try:
                if key in self._broken:
                    raise self._broken.pop(key)
                sink(StateReady(tuple(req.page_ids), req.slot, pages, req.speculative,
                                event.token_id if event else None, ready,
                                first_logprobs=event.logprobs if event else None,
                                gathered=gathered, gathered_from=since))
            except Exception as exc:  # the sink's owner is gone: end this request only
                log.exception("handoff %s: reporting progress failed", key)
                self._finish(key)
                self._drop_bands(key)
                resolve(result, error=RuntimeError(f"reporting prefill progress failed: {exc}"))
                self.engine.release(key)
                continue
            if first is not None:
                self._finish(key)
                self.metrics.prompt_done(len(req.prompt_ids), ended - started)
                if not resolve(result, first):  # its caller went away meanwhile
                    self.engine.release(key)

    def _gather(self, req, since: int, pages: int, *, final: bool) -> PromptState:
        """The full model's KV of ``req``'s pages ``[since, pages)``, and its GDN state once
        ``final``."""
        e = self.engine
        return self._followers.gather_state(e.model, e.kv_pool, e.state_pool,
                                            req.page_ids[since:pages],
                                            req.slot if final else None)

    def _drop_bands(self, key: str) -> None:
        """A request on per-rank streams ended (its handoff acknowledged, failed or never to
        finish): the followers stop sending its bands and forget it, once."""
        if key in self._banded:
            self._banded.discard(key)
            self._followers.drop_bands(int(key))

    def _finish(self, key: str) -> tuple[PrefillJob, Future, ReadySink] | None:
        """Stop tracking a request; its entry, if it was tracked."""
        self._reported.pop(key, None)
        self._broken.pop(key, None)
        self._submitted.pop(key, None)
        self._started.pop(key, None)
        return self._jobs.pop(key, None)

    def on_step_failed(self, exc: StepFailed) -> None:
        for request_id in exc.request_ids:
            entry = self._finish(request_id)
            if entry is not None:
                resolve(entry[1], error=RuntimeError(f"prefill failed: {exc.__cause__!r}"))

    def on_fatal(self, exc: BaseException) -> None:
        for _, result, _ in self._jobs.values():
            resolve(result, error=RuntimeError(f"prefill engine failed: {exc}"))
        self._jobs.clear()
        self._banded.clear()
        self._reported.clear()
        self._broken.clear()
        self._submitted.clear()
        self._started.clear()
