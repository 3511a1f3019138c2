"""A follower's CUDA graphs: the same fixed-shape forwards as rank 0's, captured and replayed in
step with rank 0's, so that the collectives inside the graphs meet.

Rank 0's :class:`~common.engine.cuda_graph.GraphRunner` (decode, or a DFLASH step's verify)
sends, through its :class:`~common.parallel.followers.FollowerLink`:

- :class:`MakeGraphs` when it is built: each follower builds a runner of the same mode, block
  length and batch sizes over its own shard and pools (its padding rows are the same scratch
  page and slot);
- :class:`CaptureGraphs` when it captures: every rank warms up and captures each size in the
  same order, largest first, so the warm-up forwards' collectives meet, and a graph's captured
  collectives are replayed on every rank alike (NCCL inside the graph);
- :class:`ReplayGraph` before each replay: the rows' cached lengths, pages and state slots, and
  the token ids when rank 0 has them on the host. When rank 0 wrote the ids on the device (the
  previous step's tokens under overlap scheduling, a DFLASH block's drafts), the message
  carries none and every rank then takes rank 0's id buffer by a device broadcast, queued
  before the replay, so rank 0 never waits for its own tokens to send them.

Only rank 0 samples and decides acceptance; a follower's replay leaves its logits unread.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.cuda_graph import GraphRunner
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.qwen3_5 import ModelOutput
from common.parallel.page_tables import FollowerTables, PagedRows


@dataclass(frozen=True)
class MakeGraphs:
    mode: ForwardMode
    q_len: int
    batch_sizes: tuple[int, ...]
    capture: bool  # False: the graphs' buffers and padding, run eagerly (CPU tests)


@dataclass(frozen=True)
class CaptureGraphs:
    mode: ForwardMode
    q_len: int


@dataclass(frozen=True)
class ReplayGraph:
    mode: ForwardMode
    q_len: int
    starts: list[int]  # per real row: tokens already cached
    rows: PagedRows  # per real row: its state slot and its pages up to the step's last token
    token_ids: list[list[int]] | None  # None: broadcast from rank 0's device buffer


GRAPH_MESSAGES = (MakeGraphs, CaptureGraphs, ReplayGraph)


class FollowerGraphs:
    """A follower's graph runners, one per (mode, block length), over its current pools."""

    def __init__(self) -> None:
        self._runners: dict[tuple[ForwardMode, int], GraphRunner] = {}

    def clear(self) -> None:
        """Drop every runner (their pools are being replaced)."""
        self._runners.clear()

    def handle(self, message, model, kv_pool, state_pool, tables: FollowerTables
               ) -> tuple[ModelOutput, ForwardBatch] | None:
        """Run one of rank 0's graph messages (``tables``: the follower's page lists); a replay
        returns its output and its padded batch (what a later commit of a VERIFY step refers
        to)."""
        key = (message.mode, message.q_len)
        if isinstance(message, MakeGraphs):
            if model is None:
                raise RuntimeError("graphs before any model was loaded")
            self._runners[key] = GraphRunner(model, kv_pool, state_pool,
                                             batch_sizes=message.batch_sizes, mode=message.mode,
                                             q_len=message.q_len, capture=message.capture)
            return None
        runner = self._runners.get(key)
        if runner is None:
            raise RuntimeError(f"no {message.mode.value} graphs of {message.q_len} tokens a row "
                               "were made on this rank")
        if isinstance(message, CaptureGraphs):
            runner.capture(progress=False)
            return None
        if isinstance(message, ReplayGraph):
            return runner.replay(message.starts, tables.pages(message.rows), message.rows.slots,
                                 message.token_ids, ids_from_leader=message.token_ids is None)
        raise TypeError(f"unknown graph message {type(message).__name__}")
