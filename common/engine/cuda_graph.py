"""CUDA-graph replay of fixed-shape forwards: the decode step, and a DFLASH step's verify.

Every request of such a forward has ``q_len`` new tokens (decode: 1; verify: the block size), so
one graph per batch size covers every step: a step of n requests runs the graph of the smallest
captured size >= n. The extra rows are padding: token 0 at position 0, written to flat KV slot 0
and GDN state slot 0 (page 0 and slot 0 are scratch, never handed to a request), attending to
scratch page 0 only; their logits are dropped.

The model reads its inputs from fixed device buffers (:class:`StaticInputs`); a step copies the
real requests' ids, positions, KV slots and state slots into them with one host-to-device copy,
refreshes the attention plan (the kind the attention backend declares in
``common/ops/graph_capabilities.py``), and replays. With ``capture=False`` the same buffers and
padding run eagerly, which is how the CPU tests check the padded path.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool
from common.engine.errors import GroupOutOfStep
from common.engine.request import Request
from common.engine.static_inputs import StaticInputs
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.qwen3_5 import HybridForCausalLM, ModelOutput
from common.progress import progress_bar

if TYPE_CHECKING:
    from common.parallel.followers import FollowerLink

log = logging.getLogger(__name__)

# as SGLang and vLLM: every small size, then coarser steps where padding costs little
_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224,
                256, 320, 384, 448, 512)


@dataclass(frozen=True)
class CudaGraphConfig:
    """How the decode step (and a DFLASH step's verify) runs on a CUDA device.

    Attributes:
        enabled: capture and replay graphs (CUDA devices only; ignored on the CPU).
        max_batch_size: the largest captured batch; bigger steps run eagerly. It is also
            capped by the scheduler's ``max_running_requests``.
        capture: False runs the graph path's fixed buffers and padding eagerly (any device):
            for tests and for telling a capture problem from a padding problem.
        commit_graphs: a greedy DFLASH step's acceptance and GDN commit replay from a graph
            of their own after the verify graph (``common/engine/commit_graph.py``); False
            launches them one by one, the baseline it is measured against.
        draft_ahead: after a greedy step's commit graph, launch the next step's draft (from
            the bonus token and committed lengths on the device) before the host reads the
            step, so the draft runs while the host takes in the step and prepares the verify
            (``DraftGraphRunner.run_next``); used when the next step has the same requests.
            Off by default: on an H100 it did not pay while the read waited for that draft
            (docs/cuda_graphs.md); with the read that no longer does, it is not yet timed.
        verify_ahead: launch the next step's verify too (its positions, KV slots and
            attention lengths moved on the device by the committed lengths) right behind
            that draft, so the whole next step runs while the host reads this one; needs
            attention plans that take lengths on the device (the ``triton`` backend's), one
            rank, no log-probabilities asked for, and pages for two blocks past the cache
            (reserved at admission when on). Implies ``draft_ahead``. Off by default here;
            timed on an H100 (2026-12-06) it took a batch-1 DFLASH step from 1.77 to 1.50 ms
            (docs/cuda_graphs.md), and the workers take it through ``step_ahead_if_planned``.
        step_ahead_if_planned: ``verify_ahead`` (and so ``draft_ahead``) where the verify's
            attention plans take lengths on the device, nothing launched ahead elsewhere (a
            draft ahead alone is not timed as paying). The workers' ``--speculative-ahead
            auto``, their default.
        tensor_parallel: capture graphs of a tensor-parallel model too, NCCL collectives
            inside them (``--tp-cuda-graphs``). Off by default: it has not run on several GPUs
            yet (docs/tensor_parallel.md); the uncaptured variant (``capture=False``) needs no
            opt-in.
    """

    enabled: bool = True
    max_batch_size: int = 256
    capture: bool = True
    commit_graphs: bool = True
    draft_ahead: bool = False
    verify_ahead: bool = False
    step_ahead_if_planned: bool = False
    tensor_parallel: bool = False

    def batch_sizes(self, max_running: int) -> tuple[int, ...]:
        top = max(1, min(self.max_batch_size, max_running))
        return tuple(s for s in _BATCH_SIZES if s < top) + (top,)


def _attention_plan(model: HybridForCausalLM, kv_pool: KVPool, *, rows: int, q_len: int,
                    make_plan: Callable[..., Any]):
    """The attention plan of ``rows`` rows of ``q_len`` tokens, from the factory the kernels'
    graph support gave (``GraphSupport.attention_plans``)."""
    c, heads = model.config, model.shard_plan.attention  # this rank's heads, not the model's
    return make_plan(
        batch_size=rows, q_len=q_len, num_qo_heads=len(heads.heads),
        num_kv_heads=len(heads.groups), head_dim=c.head_dim, page_size=kv_pool.page_size,
        max_pages=kv_pool.num_pages + rows * kv_pool.pages_for(q_len), dtype=kv_pool.kv.dtype,
        scale=c.head_dim ** -0.5)


class GraphRunner:
    """Runs fixed-shape forwards of ``mode`` (DECODE with q_len 1, or VERIFY with q_len B) of the
    target model from one CUDA graph per batch size.

    Call :meth:`capture` once the model's kernels are warm (a worker does it in warm-up); until
    then (and for batches larger than the largest size) :meth:`serves` is False and the caller
    runs the forward eagerly.

    ``after_forward(out, batch)``, when given, runs right after the forward on every row of the
    padded batch, inside the same graph (DFLASH extends its draft context there).

    ``followers``: rank 0's link to a tensor-parallel group's other ranks. Each of them then
    holds a runner of the same sizes over its own shard (``common/parallel/follower_graphs.py``),
    captures when this one does, and replays each step this one replays, so the collectives
    inside the graphs meet. Input ids written on the device reach them by a broadcast of the
    graph's id buffer just before the replay.
    """

    def __init__(self, model: HybridForCausalLM, kv_pool: KVPool, state_pool: GDNStatePool, *,
                 batch_sizes: Sequence[int], mode: ForwardMode = ForwardMode.DECODE,
                 q_len: int = 1, capture: bool = True,
                 after_forward: Callable[[ModelOutput, ForwardBatch], None] | None = None,
                 followers: FollowerLink | None = None) -> None:
        if mode == ForwardMode.DECODE and q_len != 1:
            raise ValueError("a DECODE graph has one new token per request")
        if mode == ForwardMode.EXTEND:
            raise ValueError("EXTEND batches have varying lengths and are not captured")
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.mode, self.q_len, self.capture_graphs = mode, q_len, capture
        self.after_forward = after_forward
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        device = kv_pool.kv.device
        self.inputs = StaticInputs(self.batch_sizes[-1], q_len, device)
        # the attention backend's capturable plans on a CUDA device, else plans made on the
        # host (uncaptured runs only; asking to capture them raises)
        make_plan = model.graph_support().attention_plans(model.kernels.paged_attention,
                                                          device, capture=capture)
        self.attention = {bs: _attention_plan(model, kv_pool, rows=bs, q_len=q_len,
                                              make_plan=make_plan)
                          for bs in self.batch_sizes}
        self.batches = {bs: self.inputs.batch(mode, bs, self.attention[bs])
                        for bs in self.batch_sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, ModelOutput] = {}
        self.captured = not capture  # the eager variant needs no capture
        self._planned: torch.cuda.Event | None = None
        self.followers = followers
        if followers is not None:
            followers.make_graphs(mode, q_len, self.batch_sizes, capture)

    def serves(self, num_requests: int) -> bool:
        return self.captured and 0 < num_requests <= self.batch_sizes[-1]

    def padded_size(self, num_requests: int) -> int:
        return next(bs for bs in self.batch_sizes if bs >= num_requests)

    def _plan(self, bs: int, page_ids: list[list[int]], seq_lens: list[int]) -> None:
        pad_pages = [0] * self.kv_pool.pages_for(self.q_len)
        missing = bs - len(seq_lens)
        self.attention[bs].plan(page_ids + [pad_pages] * missing,
                                seq_lens + [self.q_len] * missing)

    def pad(self, bs: int) -> None:
        """Make every row of the batch of size ``bs`` padding (before a capture's warm-up)."""
        self.inputs.fill([], [], [], [], self.kv_pool.page_size)
        self._plan(bs, [], [])

    def capture(self, progress: bool = True) -> None:
        """Capture one graph per batch size (largest first, sharing one memory pool)."""
        if not self.capture_graphs or self.captured:
            return
        if self.followers is not None:  # their warm-ups and captures meet ours' collectives
            self.followers.capture_graphs(self.mode, self.q_len)
        self.graphs, self.outputs = capture_graphs(
            self.batch_sizes, prepare=self.pad,
            forward=lambda bs: self._forward(self.batches[bs]),
            label=f"{self.mode.value} graphs", progress=progress)
        self.captured = True

    def _forward(self, batch: ForwardBatch) -> ModelOutput:
        out = self.model(batch, kv_pool=self.kv_pool, state_pool=self.state_pool)
        if self.after_forward is not None:
            self.after_forward(out, batch)
        return out

    def run(self, requests: Sequence[Request], token_ids: Sequence[Sequence[int]] | None, *,
            device_ids: Callable[[torch.Tensor, torch.Tensor], None] | None = None
            ) -> tuple[ModelOutput, ForwardBatch]:
        """Forward ``token_ids[r]`` (q_len each; None: zeros) of every request at positions
        ``num_cached..``.

        ``device_ids(ids, slots)``, when given, then writes ids the host has not read yet into
        ``ids``, the ``[n, q_len]`` view of the graph's input ids, given the rows' state slots
        (a device tensor): the previous step's tokens from the payload relay (overlap
        scheduling), or DFLASH drafts straight from the draft graph's output.
        Returns the output of the real rows (logits ``[n * q_len, V]``, views of the graph's
        buffers, valid until the next run; ``outputs[bs]`` holds every row's) and the padded
        batch (for a VERIFY commit).
        Does not advance ``num_cached``.
        """
        starts = [r.num_cached for r in requests]
        pages = [r.page_ids[:self.kv_pool.pages_for(s + self.q_len)]
                 for r, s in zip(requests, starts)]
        return self.replay(starts, pages, [r.slot for r in requests], token_ids,
                           device_ids=device_ids, tables=[r.page_ids for r in requests])

    def replay(self, starts: Sequence[int], pages: Sequence[Sequence[int]],
               slots: Sequence[int], token_ids: Sequence[Sequence[int]] | None, *,
               device_ids: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
               ids_from_leader: bool = False, tables: list[list[int]] | None = None
               ) -> tuple[ModelOutput, ForwardBatch]:
        """:meth:`run` of rows given by their cached lengths, pages and state slots (what a
        tensor-parallel follower is sent). ``ids_from_leader``: a follower's ids are rank 0's,
        broadcast on the device (rank 0 wrote them there). ``tables``: on rank 0 with
        followers, each row's request's whole page list (``FollowerLink.replay_graph``)."""
        n = len(starts)
        bs = self.padded_size(n)
        q_len, page_size = self.q_len, self.kv_pool.page_size
        seq_lens = [s + q_len for s in starts]
        self.inputs.fill(token_ids, starts, pages, slots, page_size)
        if device_ids is not None:
            device_ids(self.inputs.input_ids[:n * q_len].view(n, q_len),
                       self.inputs.state_slots[:n])
        if self.followers is None:
            return self._replay(bs, pages, seq_lens, ids_from_leader)
        ids_on_device = device_ids is not None
        self.followers.replay_graph(self.mode, q_len, starts, pages, slots,
                                    None if ids_on_device else token_ids,
                                    pages if tables is None else tables)
        try:
            return self._replay(bs, pages, seq_lens, ids_on_device)
        except Exception as exc:
            raise GroupOutOfStep(f"a tensor-parallel graph replay failed on rank 0 after the "
                                 f"followers were sent it: {type(exc).__name__}: {exc}") from exc

    @property
    def plans_on_device(self) -> bool:
        """Whether the attention plans take rows' lengths on the device (``advance``): the
        ``triton`` backend's do, FlashInfer's schedule from lengths on the host."""
        return all(callable(getattr(plan, "advance", None)) for plan in self.attention.values())

    def runs_next(self, num_requests: int) -> bool:
        """Whether :meth:`run_next` can launch a step of ``num_requests`` rows: a graph for
        them whose attention plans take lengths on the device, on one rank."""
        return self.serves(num_requests) and self.followers is None and self.plans_on_device

    def run_next(self, starts: Sequence[int], pages: Sequence[Sequence[int]],
                 lengths: torch.Tensor, first_ids: torch.Tensor, rest_ids: torch.Tensor | None,
                 table: torch.Tensor) -> tuple[ModelOutput, ForwardBatch]:
        """Launch the forward of the step after the one this runner last ran, for the same
        rows, before the host has read how far that step moved them: row r held
        ``starts[r]`` tokens in that step and holds ``starts[r] + lengths[r]`` now (lengths
        on the device, 1..q_len), its tokens are ``first_ids[r]`` and ``rest_ids[r]``.
        ``pages[r]`` must cover ``starts[r] + 2 * q_len`` positions and ``table[r]`` hold the
        same pages on the device. Returns what :meth:`run` does. Only where
        :meth:`runs_next`."""
        n, q = len(starts), self.q_len
        if not self.runs_next(n):
            raise ValueError(f"no graph of {n} rows that plans from lengths on the device")
        self.inputs.advance(n, lengths, first_ids, rest_ids, table, self.kv_pool.page_size)
        # planned for the longest block they may reach, then each row cut to its own length
        longest = [s + 2 * q for s in starts]
        return self._replay(self.padded_size(n), list(pages), longest, False,
                            delta=lengths - q)

    def _replay(self, bs: int, pages: list, seq_lens: list[int], broadcast_ids: bool, *,
                delta: torch.Tensor | None = None) -> tuple[ModelOutput, ForwardBatch]:
        n, q_len = len(seq_lens), self.q_len
        if broadcast_ids:
            self.model.tp.broadcast_from_leader(self.inputs.input_ids[:bs * q_len])
        if self._planned is not None:
            # FlashInfer plans stage through one pinned host buffer: the previous plan's copy
            # must have left it (long done unless steps overlap, and then it is the step
            # before the previous one that has to be finished)
            self._planned.synchronize()
        self._plan(bs, pages, seq_lens)
        if delta is not None:
            self.attention[bs].advance(n, delta)
        self._planned = recorded_event(self.kv_pool.kv.device)
        batch = self.batches[bs]
        if self.capture_graphs:
            if self.mode == ForwardMode.VERIFY:
                # the captured forward began its verify record at capture time; a replay does
                # not run Python, so the record of this step starts here
                self.state_pool.begin_verify(batch)
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self.outputs[bs] = self._forward(batch)  # kept as a replay's would be
        t = n * q_len
        aux = None if out.aux_hidden_states is None else out.aux_hidden_states[:t]
        return ModelOutput(logits=out.logits[:t], aux_hidden_states=aux), batch


def recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on ``device``'s current stream, to wait for that
    work alone later (None off CUDA, where the work is already done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector run once, then off until the block ends.

    A collection inside a capture may free an earlier engine's CUDA graphs, and destroying a
    graph while a stream captures is not permitted: CUDA invalidates the capture ("operation
    failed due to a previous error during capture"). torch.cuda.graph no longer collects before
    a capture (only with torch.compiler.config.force_cudagraph_gc), so garbage cycles left by an
    engine built before this one (tests, benchmarks) are collected here, outside any capture.
    SGLang and vLLM stop the collector around their captures likewise."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graphs(batch_sizes: Sequence[int], *, prepare: Callable[[int], None],
                   forward: Callable[[int], Any], label: str, progress: bool = True
                   ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Any]]:
    """One CUDA graph of ``forward(bs)`` per batch size, largest first in one memory pool.

    ``prepare(bs)`` fills the inputs with padding before the warm-up runs: two eager runs per
    size, outside the capture, so that Triton compiles and autotunes and lazy buffers exist.
    Returns the graphs and the outputs their replays write.
    """
    pool = torch.cuda.graph_pool_handle()
    sizes = sorted(batch_sizes, reverse=True)
    graphs, outputs = {}, {}
    start = time.perf_counter()
    log.info("capturing %d %s", len(sizes), label)
    with collector_paused(), \
            progress_bar(len(sizes), f"Capturing {label}", "graph", enabled=progress) as bar:
        for bs in sizes:
            bar.set_postfix_str(f"batch {bs}", refresh=False)
            prepare(bs)
            for _ in range(2):
                forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[bs] = forward(bs)
            graphs[bs] = graph
            bar.update()
    torch.cuda.synchronize()
    log.info("captured %d %s (batch %s) in %.1f s", len(sizes), label,
             ",".join(map(str, sorted(sizes))), time.perf_counter() - start)
    return graphs, outputs
