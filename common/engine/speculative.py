"""One DFLASH step for a batch of running requests: draft a block, verify it with the target,
keep the accepted prefix, roll the GDN state back to it, extend the draft's context.

Block of request r: ``[last committed token, MASK x (B-1)]`` at positions ``start..start+B-1``
where ``start = num_cached`` (the last committed token is the only one not yet in the cache).
Proposals are greedy; acceptance is ``common.engine.acceptance`` (lossless for any sampler).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from common.cache.kv_pool import KVPool, page_table
from common.cache.state_pool import GDNStatePool
from common.engine.acceptance import (Acceptance, GreedyReader, accept_greedy,
                                     accept_sampled_rows, greedy_match, read_greedy)
from common.engine.commit_graph import GreedyCommitGraphs
from common.engine.cuda_graph import CudaGraphConfig, GraphRunner, recorded_event
from common.engine.draft_graph import DraftGraphRunner
from common.engine.request import Request
from common.engine.step_logprobs import logprobs_per_row
from common.logprobs import TokenLogprobs
from common.model.dflash import DFlashDraftModel, DraftKVPool
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.qwen3_5 import HybridForCausalLM, ModelOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    """What one request got from a step: ``acceptance.commit_len`` tokens in ``tokens``, and
    their log-probabilities when the request asks for them (the target's, at each token's
    position of the verified block)."""

    request: Request
    tokens: list[int]
    acceptance: Acceptance
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class _DraftAhead:
    """A proposal launched before its step (``DraftGraphRunner.run_next``), and the rows it
    assumed: used only by a step of the same requests, in the same order, each where the
    previous step left it. ``verify``: the step's verify launched behind it
    (``GraphRunner.run_next``), with the proposals' host copy and the event after it."""

    requests: tuple[Request, ...]
    starts: tuple[int, ...]
    last_tokens: tuple[int, ...]
    drafts: torch.Tensor
    verify: tuple[ModelOutput, ForwardBatch] | None = None
    drafts_host: torch.Tensor | None = None
    drafts_copied: torch.cuda.Event | None = None

    def fits(self, requests: list[Request]) -> bool:
        return (len(requests) == len(self.requests)
                and all(r is a and r.num_cached == s and r.output_ids[-1] == t
                        for r, a, s, t in zip(requests, self.requests, self.starts,
                                              self.last_tokens)))


class DFlashSpeculator:
    """Owns the draft and its context pool (same page ids as the target's KV pool).

    Args:
        block_size: B, tokens verified per step (default: the draft's trained block size).
        max_requests: rows to reserve verify buffers for up front (0: this engine only
            builds draft context, as a prefill worker does).
        graphs: replay the draft proposal and the verify forward from CUDA graphs (after
            :meth:`capture_graphs`), for batches of up to ``VERIFY_GRAPH_TOKENS // B`` requests.
        max_graph_tokens: a lower cap on the tokens of a captured verify, from the target's ops
            (none when it is below B).
        runner: a tensor-parallel target's runner (rank 0's): the verify forward (eager, or
            from graphs its followers replay too) and the commit go through it, so the
            followers run them too. The draft runs on rank 0 only, and acceptance is decided
            there, once; after the greedy commit graphs the accepted lengths reach the
            followers by a device broadcast, never read on the host first.
        vocab: the full input embedding and output weight ``([V, H], [V, H])`` the draft
            reads, where the target holds only its rows of them (tensor parallelism).
    """

    # the largest captured verify forward, in tokens: its fp32 logits alone are
    # tokens x vocab x 4 bytes (1 GiB at Qwen3.5's vocabulary)
    VERIFY_GRAPH_TOKENS = 1024

    def __init__(self, target: HybridForCausalLM, draft: DFlashDraftModel, kv_pool: KVPool,
                 state_pool: GDNStatePool, *, block_size: int | None = None,
                 max_requests: int = 1, graphs: CudaGraphConfig | None = None,
                 max_graph_tokens: int | None = None, runner=None,
                 vocab: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.target, self.draft = target, draft
        self.runner = runner
        self.vocab = vocab
        self.block_size = block_size or draft.config.block_size
        if self.block_size < 2:
            raise ValueError(f"block size must be at least 2, got {self.block_size}")
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.draft_pool = DraftKVPool.like(kv_pool, draft.config)
        self.mask_token_id = draft.config.mask_token_id
        target.set_dflash_layers_to_capture(draft.config.target_layer_ids)
        if max_requests > 0:
            state_pool.reserve_verify(max_requests, self.block_size)
        self.stats = {"spec_steps": 0, "spec_committed_tokens": 0, "spec_drafted_tokens": 0}
        self.verify_graphs = self.draft_graphs = self.commit_graphs = None
        # what of the next step goes ahead of the read: set with the graphs it runs from
        self.verify_ahead = self.draft_ahead = False
        self._ahead: _DraftAhead | None = None
        self._reader = GreedyReader(kv_pool.kv.device, max(1, max_requests))
        tokens = self.VERIFY_GRAPH_TOKENS if max_graph_tokens is None \
            else min(self.VERIFY_GRAPH_TOKENS, max_graph_tokens)
        if graphs is not None and max_requests > 0 and tokens >= self.block_size:
            cap = min(max_requests, tokens // self.block_size)
            sizes = graphs.batch_sizes(cap)
            # the draft context of every verified token is written inside the verify graph;
            # rejected tokens' entries lie past the committed length, where nothing reads them
            # before a later step overwrites them (as with the target's KV)
            self.verify_graphs = GraphRunner(
                target, kv_pool, state_pool, batch_sizes=sizes, mode=ForwardMode.VERIFY,
                q_len=self.block_size, capture=graphs.capture,
                after_forward=lambda out, batch: self.extend_context(out.aux_hidden_states,
                                                                     batch),
                followers=None if runner is None else runner.followers)
            self.draft_graphs = DraftGraphRunner(
                draft, target, self.draft_pool, batch_sizes=sizes, block_size=self.block_size,
                mask_token_id=self.mask_token_id, capture=graphs.capture, vocab=vocab)
            planned = self.verify_graphs.plans_on_device
            self.verify_ahead = graphs.verify_ahead or (graphs.step_ahead_if_planned and planned)
            self.draft_ahead = graphs.draft_ahead or self.verify_ahead
            if graphs.verify_ahead and not planned:
                log.warning("verify_ahead is on, but the verify's attention plans schedule "
                            "from lengths on the host (paged_attention=%s): only the draft is "
                            "launched ahead (--kernels gpu-triton-attention plans on the "
                            "device)", target.graph_support().attention_backend)
            if graphs.commit_graphs:
                # rank 0's own commit inside the graph; the followers' follows it (step)
                self.commit_graphs = GreedyCommitGraphs(
                    batch_sizes=sizes, block_size=self.block_size, state_pool=state_pool,
                    buffers=self._step_buffers, pad=self.verify_graphs.pad,
                    commit=lambda batch, lengths: self.target.commit_verified(
                        batch, lengths, state_pool=self.state_pool),
                    capture=graphs.capture)

    @property
    def lookahead_tokens(self) -> int:
        """Positions past a request's cache its steps may write: one block, or two where the
        next step's verify is launched before this one's is read."""
        return 2 * self.block_size if self.verify_ahead else self.block_size

    def capture_graphs(self, progress: bool = True) -> None:
        # the commit graphs read the others' outputs: captured last
        for runner in (self.draft_graphs, self.verify_graphs, self.commit_graphs):
            if runner is not None:
                runner.capture(progress)

    def _step_buffers(self, bs: int):
        """The draft proposals, verify logits and verify batch of batch size ``bs`` (all rows),
        the inputs of the greedy commit graphs."""
        return (self.draft_graphs.outputs[bs], self.verify_graphs.outputs[bs].logits,
                self.verify_graphs.batches[bs])

    def extend_context(self, aux_hidden: torch.Tensor, batch: ForwardBatch,
                       rows: torch.Tensor | None = None) -> None:
        """Add the draft context of ``batch``'s new tokens (or only ``rows`` of them)."""
        positions, locs = batch.positions, batch.out_cache_loc
        if rows is not None:
            aux_hidden, positions, locs = aux_hidden[rows], positions[rows], locs[rows]
        self.draft.extend_context(aux_hidden, positions, locs, self.draft_pool)

    def propose(self, requests: list[Request], pages: list[list[int]]) -> torch.Tensor:
        """Greedy drafts ``[N, B-1]`` for the requests' blocks (``pages[r]``: request r's pages,
        covering at least its context)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.fits(requests):
            return ahead.drafts  # launched before the previous step was read
        if self.draft_graphs is not None and self.draft_graphs.serves(len(requests)):
            return self.draft_graphs.run(requests, pages)
        b = self.block_size
        device = self.kv_pool.kv.device
        blocks = torch.full((len(requests), b), self.mask_token_id, dtype=torch.int64,
                            device=device)
        blocks[:, 0] = torch.tensor([r.output_ids[-1] for r in requests], device=device)
        logits = self.draft.propose(
            block_ids=blocks, start_positions=[r.num_cached for r in requests],
            page_table=page_table(pages, device), pool=self.draft_pool,
            embed=self.target.get_input_embeddings().weight if self.vocab is None
            else self.vocab[0],
            lm_head=self.target.get_output_weight() if self.vocab is None else self.vocab[1])
        return logits.argmax(-1)

    def _commit(self, batch: ForwardBatch, lengths) -> None:
        if self.runner is not None:
            self.runner.commit_verified(batch, lengths)  # decided here, committed everywhere
        else:
            self.target.commit_verified(batch, lengths, state_pool=self.state_pool)

    def step(self, requests: list[Request], seed_for) -> list[StepOutcome]:
        """Run one DFLASH step; every request's cache then holds its committed tokens.

        Args:
            seed_for: ``(request) -> None`` reseeds a sampled request's generator for its
                next output position (the engine's rule, so seeded outputs are reproducible).
        """
        b, page_size = self.block_size, self.kv_pool.page_size
        n = len(requests)
        ahead = None
        pages = [r.page_ids[:self.kv_pool.pages_for(r.num_cached + b)] for r in requests]
        if any(len(p) * page_size < r.num_cached + b for p, r in zip(pages, requests)):
            raise ValueError("a speculative request needs pages for block_size tokens past its "
                             "cache (reserve them at admission)")
        device = self.kv_pool.kv.device
        came = self._ahead
        if came is not None and came.verify is not None and came.fits(requests):
            # drafted and verified while the host read the step before
            self._ahead = None
            drafts, (out, batch) = came.drafts, came.verify
            drafts_host, drafts_copied = came.drafts_host, came.drafts_copied
        elif self.verify_graphs is not None and self.verify_graphs.serves(n):
            drafts = self.propose(requests, pages)  # [N, B-1] on the device
            # the drafts reach the verify's inputs on the device, and the host a copy of them
            # by acceptance's read: no wait between the draft and the verify graph
            drafts_host = drafts.to("cpu", non_blocking=True)
            drafts_copied = recorded_event(drafts.device)
            firsts = [[r.output_ids[-1]] + [0] * (b - 1) for r in requests]
            out, batch = self.verify_graphs.run(
                requests, firsts, device_ids=lambda ids, _: ids[:, 1:].copy_(drafts))
            # (the verify graph also extends the draft context)
        else:
            drafts = self.propose(requests, pages)
            drafts_host, drafts_copied = drafts.cpu(), None
            tokens = [[r.output_ids[-1]] + d for r, d in zip(requests, drafts_host.tolist())]
            args = dict(mode=ForwardMode.VERIFY, token_ids=tokens,
                        prefix_lens=[r.num_cached for r in requests], page_ids=pages,
                        page_size=page_size, state_slots=[r.slot for r in requests])
            if self.runner is not None:
                # the followers verify too
                out, batch = self.runner.forward(args, tables=[r.page_ids for r in requests])
            else:
                batch = ForwardBatch.build(**args, device=device)
                out = self.target(batch, kv_pool=self.kv_pool, state_pool=self.state_pool)
            self.extend_context(out.aux_hidden_states, batch)
        logits = out.logits.view(n, b, -1)
        padding = batch.num_requests - n  # padding rows of a graph batch: scratch slot 0
        if all(r.params.is_greedy for r in requests):
            # acceptance and commit are queued behind the verify on the device, and the host
            # reads the outcome once, after both: the GPU does not idle between them
            if (self.commit_graphs is not None and self.draft_graphs.serves(n)
                    and self.verify_graphs.serves(n) and self.commit_graphs.serves(batch)):
                matched, lengths = self.commit_graphs.run(batch)
                if self.runner is not None:  # the graph's lengths, for every rank
                    self.runner.followers.commit_from_device(lengths.to(torch.int64))
                # a draft launched ahead is wasted when the batch changes (a request ends or
                # joins): one draft per change, where waiting for the read costs one per step.
                # The read's copy is queued before it, so the host takes in this step while
                # the draft runs
                read = self._reader.start(matched[:, :n])
                if self.draft_ahead:
                    ahead = self._launch_next(requests, matched[1], lengths, pages)
                accepted = read()
            else:
                matched = greedy_match(drafts, logits)
                lengths = F.pad(matched[0] + 1, (0, padding), value=1)
                self._commit(batch, lengths)
                accepted = read_greedy(matched)
        else:
            accepted = self._accept(requests, drafts, logits, seed_for)
            self._commit(batch, [a.commit_len for a in accepted] + [1] * padding)
        commits = [a.commit_len for a in accepted]
        if drafts_copied is not None:
            drafts_copied.synchronize()  # long done: acceptance read the host after it
        outcomes = []
        for i, (r, d, a) in enumerate(zip(requests, drafts_host.tolist(), accepted)):
            r.num_cached += a.commit_len
            tokens = d[:a.num_accepted] + [a.bonus]
            outcomes.append(StepOutcome(r, tokens, a, self._logprobs(r, logits[i], tokens)))
        if ahead is not None:
            self._ahead = replace(ahead, requests=tuple(requests),
                                  starts=tuple(r.num_cached for r in requests),
                                  last_tokens=tuple(a.bonus for a in accepted))
        self.stats["spec_steps"] += n
        self.stats["spec_committed_tokens"] += sum(commits)
        self.stats["spec_drafted_tokens"] += n * (b - 1)
        return outcomes

    def _launch_next(self, requests: list[Request], bonus: torch.Tensor, lengths: torch.Tensor,
                     pages: list[list[int]]) -> _DraftAhead:
        """Launch the next step's draft, and its verify where it can be, for the same rows
        from this step's ``bonus`` tokens and committed ``lengths`` on the device (the rows it
        assumed are filled in once the step is read)."""
        b, n = self.block_size, len(requests)
        # the next verify writes over this one's logits, so none may be read after it
        # (log-probabilities); and the pages of the block after next must be there already
        verify = (self.verify_ahead and self.verify_graphs.runs_next(n) and self.runner is None
                  and all(r.params.logprobs is None for r in requests))
        if verify:
            reach = [self.kv_pool.pages_for(r.num_cached + 2 * b) for r in requests]
            if all(len(r.page_ids) >= k for r, k in zip(requests, reach)):
                pages = [r.page_ids[:k] for r, k in zip(requests, reach)]
            else:
                verify = False
        drafts = self.draft_graphs.run_next(bonus, lengths, pages)
        if not verify:
            return _DraftAhead((), (), (), drafts)
        drafts_host = drafts.to("cpu", non_blocking=True)
        copied = recorded_event(drafts.device)
        out = self.verify_graphs.run_next(
            [r.num_cached for r in requests], pages, lengths, bonus, drafts,
            self.draft_graphs.page_table)
        return _DraftAhead((), (), (), drafts, verify=out, drafts_host=drafts_host,
                           drafts_copied=copied)

    @staticmethod
    def _logprobs(r: Request, logits: torch.Tensor,
                  tokens: list[int]) -> list[TokenLogprobs] | None:
        """The committed ``tokens``' log-probabilities from the request's verify ``logits``
        [B, V]: row j is the target's distribution at the block's position j."""
        if r.params.logprobs is None:
            return None
        return logprobs_per_row(logits[:len(tokens)],
                                torch.tensor(tokens, device=logits.device),
                                [r.params.logprobs] * len(tokens))

    def _accept(self, requests, drafts, logits, seed_for) -> list[Acceptance]:
        """Acceptance of a batch with sampled requests (greedy rows by argmax, the others by
        rejection sampling on the host)."""
        greedy_rows = [i for i, r in enumerate(requests) if r.params.is_greedy]
        result: list[Acceptance | None] = [None] * len(requests)
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            for i, a in zip(greedy_rows, accept_greedy(drafts[index], logits[index])):
                result[i] = a
        sampled = [i for i, r in enumerate(requests) if result[i] is None]
        for i in sampled:
            seed_for(requests[i])
        index = torch.tensor(sampled, device=logits.device)
        for i, a in zip(sampled, accept_sampled_rows(
                drafts[index], logits[index], [requests[i].params for i in sampled],
                [requests[i].generator for i in sampled])):
            result[i] = a
        return result

