"""The in-process engine: requests in, tokens out, continuous batching over one model."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.cache.pools import CacheConfig, make_pools  # noqa: F401 - re-exported
from common.engine.engine_config import EngineConfig  # noqa: F401 - re-exported
from common.engine.errors import StepFailed, is_device_fault
from common.engine.graph_policy import decode_graph_runner, graphs_apply
from common.engine.layer_progress import LayerProgress
from common.engine.model_runner import ModelRunner
from common.engine.overlap import InFlight, OverlapDecoder
from common.engine.request import Request
from common.engine.scheduler import ScheduledStep, Scheduler
from common.engine.speculative import DFlashSpeculator
from common.engine.step_logprobs import logprobs_per_row
from common.logprobs import TokenLogprobs, check_asked
from common.model.dflash import DFlashDraftModel
from common.model.forward_batch import ForwardMode
from common.model.qwen3_5 import HybridForCausalLM
from common.engine.sampler import Sampler, make_generator
from common.sampling import SamplingParams, stop_reason

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """A token a request produced in one step; ``finish_reason`` is set on its last token.

    ``held`` marks the first token of a request kept for handoff (``hold_after_prefill``).
    A speculative step yields several events for one request, in order.
    """

    request_id: str
    token_id: int
    finish_reason: str | None
    held: bool = False
    # on the first token of a speculative step: the tokens that step committed (accepted + 1)
    accept_length: int | None = None
    # when the request asked for them (SamplingParams.logprobs)
    logprobs: TokenLogprobs | None = None


def step_seed(seed: int, position: int) -> int:
    """The generator seed for a request's ``position``-th output token."""
    return (seed * 1_000_003 + position * 7_919 + 1) % (1 << 63)


def warmup_groups(room: int, sm_count: int | None) -> list[tuple[int, int]]:
    """The warm-up's prefill batches as ``(first, end)`` request indices: one prompt alone,
    then up to 8 together, then (on a GPU of ``sm_count`` SMs) up to as many as it has SMs,
    which crosses FlashInfer's line (sequences x heads at half the SMs) for any head count: a
    target of 8 value heads stayed below it at 8 sequences, and the first burst of 32
    requests after start waited about 2 s for that kernel's compilation. ``room``: how many
    requests the engine can hold at once."""
    sizes = [min(8, room)] + ([min(sm_count, room)] if sm_count else [])
    groups = [(0, 1)]
    for size in sizes:
        if size > groups[-1][1]:
            groups.append((groups[-1][1], size))
    return groups


class LLMEngine:
    """Continuous batching over a model and its pools. Not thread-safe: one caller at a time."""

    def __init__(self, model: HybridForCausalLM, config: EngineConfig,
                 eos_token_ids: tuple[int, ...] = (), *, draft: DFlashDraftModel | None = None,
                 block_size: int | None = None,
                 draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``draft_vocab``: with a draft and a tensor-parallel model, the full input embedding
        and output weight the draft reads (rank 0 holds only its rows of the target's)."""
        self.model = model
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids) or model.config.eos_token_ids
        if model.tp.world_size > 1:
            if not model.tp.is_leader:
                raise ValueError(f"rank {model.tp.rank} of a tensor-parallel group follows "
                                 "rank 0's engine; it does not run one")
            if draft is not None and draft_vocab is None:
                raise ValueError("a draft of a tensor-parallel target needs the full "
                                 "vocabulary weights (draft_vocab)")
        self.kv_pool, self.state_pool = make_pools(model, config.cache, config.device)
        token_cap = self._graph_token_cap()
        graphs_on = graphs_apply(model, config, token_cap)
        sharded = model.tp.world_size > 1
        followers = None
        if sharded:
            from common.parallel.followers import FollowerLink

            followers = FollowerLink(model.tp)
        graphs = decode_graph_runner(model, config, self.kv_pool, self.state_pool,
                                     token_cap, followers) if graphs_on else None
        self.runner = ModelRunner(model, self.kv_pool, self.state_pool, config.device,
                                  graphs=graphs, followers=followers)
        self.speculator = None if draft is None else DFlashSpeculator(
            model, draft, self.kv_pool, self.state_pool, block_size=block_size,
            max_requests=0 if config.hold_after_prefill
            else config.scheduler.max_running_requests,
            graphs=config.cuda_graph if graphs_on else None,
            max_graph_tokens=token_cap if graphs_on else None,
            runner=self.runner if sharded else None, vocab=draft_vocab if sharded else None)
        # a verify block writes block_size positions past the cache: reserve room for them
        # (and for the block after it, where the next verify is launched before the read)
        lookahead = self.speculator.lookahead_tokens if self.speculator else 0
        self.scheduler = Scheduler(replace(config.scheduler, lookahead_tokens=lookahead),
                                   self.kv_pool, self.state_pool)
        # the pools' one owner (reserve, give back), for local requests and handoffs alike
        self.cache = self.scheduler.cache
        self.overlap = None
        if config.overlap_schedule and self.runner.graphs is not None:
            self.overlap = OverlapDecoder(self.runner.graphs, config.cache.num_slots)
        self.sampler = Sampler()
        # called with an EXTEND step (``num_cached`` not yet advanced) and the progress of its
        # forward just before the forward starts: a prefill worker's handoff reads each
        # layer's state once that layer has run (``common/engine/layer_progress.py``)
        self.on_extend: Callable[[ScheduledStep, LayerProgress], None] | None = None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._stepping: list[Request] = []  # requests of the step now running (for StepFailed)

    def _graph_token_cap(self) -> int | None:
        """Most tokens one captured forward may hold, as the backends of the model's ops
        declare (``common/ops/graph_capabilities.py``; None: no limit; 0: an op no graph can
        replay)."""
        return self.model.graph_support().max_tokens

    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Capture the decode (and DFLASH verify) graphs; a no-op without them. Kernels must
        be warm: call after a first request has run, as :meth:`warmup` does."""
        if self.runner.graphs is not None:
            self.runner.graphs.capture(progress)
        if self.speculator is not None:
            self.speculator.capture_graphs(progress)

    def wants_speculation(self, speculative: bool | None) -> bool:
        """Whether a request arriving now speculates: when this engine has a draft, unless it
        asked not to, or it left the choice to the engine (None) and the engine already holds
        ``speculative_disable_by_batch_size`` requests. A prefill worker decodes nothing, so
        its choice (whether to make the draft context) ignores its own load."""
        if self.speculator is None or speculative is False:
            return False
        limit = self.config.speculative_disable_by_batch_size
        if speculative is None and limit is not None and not self.config.hold_after_prefill:
            return len(self.requests) < limit
        return True

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Queue a prompt; it speculates when ``wants_speculation(params.speculative)``."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_ids), params,
                      generator=make_generator(params.seed, self.config.device),
                      speculative=self.wants_speculation(params.speculative))
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def admit_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int,
                        params: SamplingParams, page_ids: list[int], slot: int, *,
                        speculative: bool = False,
                        first_logprobs: TokenLogprobs | None = None) -> TokenEvent:
        """Continue a request whose prompt state is already in ``page_ids`` / ``slot`` (a
        handoff) and whose first token was sampled elsewhere. Returns that token's event.
        ``speculative`` (decode it with the draft) is the caller's decision, not
        ``params.speculative``: only the handoff says whether the prompt's draft context is in
        the draft pool too;
        ``first_logprobs`` exactly when the request asks for log-probabilities."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if speculative and self.speculator is None:
            raise ValueError("a speculative request needs an engine with a draft")
        check_asked(first_logprobs, params.logprobs)
        req = Request(request_id, list(prompt_ids), params,
                      generator=make_generator(params.seed, self.config.device),
                      num_cached=len(prompt_ids), page_ids=list(page_ids), slot=slot,
                      speculative=speculative)
        self.requests[request_id] = req
        self.scheduler.admit_prefilled(req)
        if self.overlap is not None:
            self.overlap.note_tokens([slot], torch.tensor([first_token]))
        return self._append(req, first_token, logprobs=first_logprobs)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its cache; False if it is unknown (already finished)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.finish_reason = "abort"
        self.scheduler.release(req)
        return True

    def release(self, request_id: str) -> None:
        """Free a held (handed-off or failed) request's cache."""
        self.abort(request_id)

    def has_work(self) -> bool:
        """A step now would compute something (False while every waiting request waits for
        room that only a release can make)."""
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        return in_flight or self.scheduler.can_schedule()

    def step(self) -> list[TokenEvent]:
        """Run one scheduled step; return the tokens it produced, in order per request.

        With overlap scheduling a plain decode step is launched and the tokens returned are
        those of the step launched before it.

        Raises :class:`StepFailed` when the step raised for its requests: those requests are
        ended with "error" and freed, every other request and the engine carry on. A device
        fault (:func:`is_device_fault`) is raised as it is: the engine cannot go on."""
        self._stepping = []
        try:
            return self._run_step()
        except Exception as exc:
            if is_device_fault(exc):
                raise
            log.exception("step failed for %d request(s)", len(self._stepping))
            raise StepFailed(self._fail_stepping(), exc) from exc

    @property
    def last_step_requests(self) -> list[Request]:
        """The requests the latest :meth:`step` ran (a prefill worker streams their progress)."""
        return list(self._stepping)

    def _fail_stepping(self) -> list[str]:
        """End the requests of the failed step (and of a launched one) with "error"."""
        victims = list(self._stepping)
        if self.overlap is not None:
            flight = self.overlap.take()
            victims += flight.requests if flight is not None else []
        failed = []
        for r in dict.fromkeys(victims):
            if self.requests.pop(r.request_id, None) is not None:
                r.finish_reason = "error"
                self.scheduler.release(r)
                failed.append(r.request_id)
        return failed

    def _schedule(self) -> ScheduledStep | None:
        step = self.scheduler.schedule()
        if step is not None:
            self._stepping += step.requests
        return step

    def _run_step(self) -> list[TokenEvent]:
        if self.overlap is None:
            return self._step()
        running = self.scheduler.running
        if running and not self.scheduler.waiting and self.overlap.can_launch(running):
            step = self._schedule()  # DECODE of every running request
            return self._collect(self.overlap.launch(step.requests, self._sample_launched))
        return self._collect(self.overlap.take()) + self._step()

    def _sample_launched(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Tokens of an overlapped step, on the device: each request's position counts the
        token still in flight."""
        for r in reqs:
            self._reseed(r, len(r.output_ids) + self.overlap.pending_for(r))
        return self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])

    def _collect(self, step: InFlight | None) -> list[TokenEvent]:
        """Events of a launched step; requests that finished (or were aborted) since it was
        launched drop their extra token."""
        if step is None:
            return []
        self._stepping += step.requests
        tokens = self.overlap.collect(step)
        return [self._append(r, tok, logprobs=lp)
                for r, tok, lp in zip(step.requests, tokens, step.token_logprobs())
                if r.finish_reason is None]

    def _step(self) -> list[TokenEvent]:
        step = self._schedule()
        if step is None:
            return []
        if step.mode == ForwardMode.DECODE and self.speculator is not None:
            speculative = [r for r in step.requests if r.speculative]
            plain = [r for r in step.requests if not r.speculative]
            events = self._forward(ScheduledStep(ForwardMode.DECODE, plain, [1] * len(plain))) \
                if plain else []
            return events + (self._speculate(speculative) if speculative else [])
        return self._forward(step)

    def _forward(self, step: ScheduledStep) -> list[TokenEvent]:
        """One target forward (EXTEND or DECODE) and a token for each request it completes."""
        if step.mode == ForwardMode.EXTEND and self.on_extend is not None:
            out, batch = self.runner.run_reporting(step, self.on_extend)
        else:
            out, batch = self.runner.run(step)
        if self.speculator is not None and step.mode == ForwardMode.EXTEND:
            rows = [t for r, start, n in zip(step.requests, batch.cu_seqlens.tolist(),
                                             batch.extend_lens) if r.speculative
                    for t in range(start, start + n)]
            if rows:
                self.speculator.extend_context(out.aux_hidden_states, batch,
                                               torch.tensor(rows, device=batch.positions.device))
        # a chunk that does not finish its prompt produces no token
        sampled = [(i, r) for i, r in enumerate(step.requests) if not r.is_prefilling]
        if not sampled:
            return []
        reqs = [r for _, r in sampled]
        logits = out.logits
        if len(sampled) < len(step.requests):
            logits = logits[torch.tensor([i for i, _ in sampled], device=logits.device)]
        for r in reqs:
            self._reseed(r)
        tokens = self.sampler.sample(logits, [r.params for r in reqs],
                                     [r.generator for r in reqs])
        if self.overlap is not None:
            self.overlap.note_tokens([r.slot for r in reqs], tokens)
        per_row = logprobs_per_row(logits, tokens, [r.params.logprobs for r in reqs])
        return [self._append(r, tok, logprobs=lp)
                for r, tok, lp in zip(reqs, tokens.tolist(), per_row)]

    def _speculate(self, requests: list[Request]) -> list[TokenEvent]:
        events = []
        for outcome in self.speculator.step(requests, self._reseed):
            r = outcome.request
            r.accept_lengths.append(outcome.acceptance.commit_len)
            for i, tok in enumerate(outcome.tokens):
                event = self._append(r, tok, outcome.acceptance.commit_len if i == 0 else None,
                                     logprobs=outcome.logprobs[i] if outcome.logprobs else None)
                events.append(event)
                if event.finish_reason is not None:
                    break  # nothing after a stop token (or the length limit) is emitted
        return events

    @staticmethod
    def _reseed(r: Request, position: int | None = None) -> None:
        """Seed a seeded request's generator for its output ``position`` (default: the next)."""
        if r.generator is not None:
            # NOTE: reseeding per position makes a seeded request's tokens independent of
            # where its earlier tokens were sampled (prefill worker, decode worker, locally).
            position = len(r.output_ids) if position is None else position
            r.generator.manual_seed(step_seed(r.params.seed, position))

    def _append(self, r: Request, tok: int, accept_length: int | None = None, *,
                logprobs: TokenLogprobs | None = None) -> TokenEvent:
        r.output_ids.append(tok)
        if logprobs is not None:
            r.logprobs.append(logprobs)
        if self.config.hold_after_prefill:
            self.scheduler.detach(r)
            return TokenEvent(r.request_id, tok, None, held=True, logprobs=logprobs)
        reason = stop_reason(tok, len(r.output_ids), r.params, self.eos_token_ids)
        if reason is not None:
            r.finish_reason = reason
            self.scheduler.release(r)
            del self.requests[r.request_id]
        return TokenEvent(r.request_id, tok, reason, accept_length=accept_length,
                          logprobs=logprobs)

    def warmup(self, progress: bool = True) -> None:
        """Run short requests through every path this engine serves (batched prefill and
        decode, a DFLASH step), so that kernels compile before a worker reports SERVING.
        ``progress``: a progress bar for the graph capture (on a terminal only)."""
        steps = self.speculator.block_size + 2 if self.speculator else 3
        params = SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True)
        # one prompt prefilled alone, then prompts of different lengths in one step: kernels
        # pick other variants for one sequence and for a batch (FlashInfer's GDN prefill leaves
        # its context-parallel kernel once sequences x heads reach half the SMs). A variant's
        # first use compiles it on the engine thread, holding the GIL for seconds (a served
        # request's and the worker's load reports would wait), so each must happen here
        room = min(self.state_pool.allocator.num_free,
                   self.config.scheduler.max_running_requests)
        groups = warmup_groups(room, self._sm_count())
        keys = [f"__warmup__{i}" for i in range(groups[-1][1])]
        held: set[str] = set()

        def step_while(busy) -> None:
            while busy() and self.has_work():
                held.update(e.request_id for e in self.step() if e.held)

        # the SM-sized group only prefills: its first token ends it, with no DFLASH step (the
        # verify logits of 132 x 16 rows of a 248k vocabulary would take 2 GB for nothing)
        wide = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True,
                              speculative=False)
        for n, (first, end) in enumerate(groups):
            for i in range(first, end):
                self.add_request(list(range(1, 9 - i % 4)), params if n < 2 else wide,
                                 request_id=keys[i])
            # this group's prefill is over once each has its first token (held or not)
            step_while(lambda: any(k in self.requests and not self.requests[k].output_ids
                                   for k in keys[first:end]))
        step_while(lambda: any(k in self.requests and k not in held for k in keys))
        for key in keys:
            self.abort(key)  # a request held for handoff (prefill workers) still owns its cache
        self.capture_cuda_graphs(progress)

    def _sm_count(self) -> int | None:
        """The GPU's streaming multiprocessors (None on the CPU)."""
        device = torch.device(self.config.device)
        if device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(device).multi_processor_count

    def load(self) -> dict[str, int]:
        """Free and total capacity, queue lengths: what a worker reports to the router.

        Safe to call from any thread (allocators lock; the rest are single reads), so a load
        report never waits for a step to finish."""
        return {
            "free_pages": self.kv_pool.allocator.num_free,
            "total_pages": self.kv_pool.allocator.num_usable,
            "free_slots": self.state_pool.allocator.num_free,
            "total_slots": self.state_pool.allocator.num_usable,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            **(self.speculator.stats if self.speculator else {}),
        }

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run prompts to completion; returns the finished requests in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        while self.scheduler.num_requests:
            if not self.has_work():
                raise RuntimeError("requests are waiting for room that nothing will free")
            self.step()
        return reqs
