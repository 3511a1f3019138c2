"""Rank 0 drives, the other ranks follow: the messages of a tensor-parallel group.

Rank 0 owns the whole engine (scheduler, pools' bookkeeping, sampling). The followers own only
their shard of the model and of the pools, and do what rank 0 broadcasts, in order:

- :class:`LoadModel`: build this rank's shard of a model and its pools;
- :class:`MakePools`: make this rank's pools again, at the sizes rank 0 chose for its own (pools
  sized by ``--mem-fraction``: rank 0 profiles with the followers on small pools first);
- :class:`ReportMemory`: join rank 0 in finding the free and total memory of the tightest
  rank's device (:meth:`TensorParallelGroup.min_over_ranks`);
- :class:`RunForward`: one forward over a batch described by ``ForwardBatch.build``'s
  arguments (token ids, prefix lengths, page ids, state slots), so each follower builds the same
  indices rank 0 built and runs the same layers, meeting rank 0 in every collective;
- the CUDA graphs' messages (``common/parallel/follower_graphs.py``): build, capture and
  replay the same decode and verify graphs as rank 0, in step with it;
- :class:`CommitVerified`: fold the accepted prefix of the latest VERIFY forward into the GDN
  state (DFLASH: rank 0 runs the draft and decides acceptance; the followers only verify and
  commit);
- :class:`GatherState` / :class:`ScatterState`: send this rank's part of one request's KV
  pages and GDN slot to rank 0, or take its part of a full state from rank 0
  (``common/parallel/prompt_state.py``): a handoff carries the full model's state, and only
  rank 0 speaks to the other worker;
- the per-rank handoff streams' messages (``common/parallel/band_messages.py``): send this
  rank's heads of a request's state straight to the decode ranks, or land them straight into
  this rank's pools, instead of a gather or a scatter through rank 0. A follower runs them
  with the handler its worker gave the group (the sender or receiver is the service's), and
  refuses them without one;
- :class:`Stop`: leave the loop.

Tokens are decided once, on rank 0: a follower never samples, because the next forward's token
ids arrive in its batch. No random state has to agree across ranks, and an unseeded request is
as consistent as a seeded one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.cache.pools import CacheConfig, make_pools
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.engine.errors import GroupOutOfStep
from common.parallel import band_messages, follower_graphs, prompt_state
from common.parallel.band_messages import BAND_MESSAGES, BandHandlerFactory
from common.parallel.follower_graphs import GRAPH_MESSAGES, FollowerGraphs
from common.parallel.page_tables import FollowerTables, LeaderTables, PagedRows
from common.parallel.group import TensorParallelGroup
from common.parallel.prompt_state import PromptState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSettings:
    """What a follower builds its shard from (rank 0's engine settings, less what only rank 0
    uses). ``kernels``: a kernel set name (``--kernels``) or None for the model's default;
    ``expert_parallel``: whole routed experts per rank."""

    model: str
    dtype: torch.dtype | None
    kernels: str | None
    cache: CacheConfig
    expert_parallel: bool = False


@dataclass(frozen=True)
class LoadModel:
    settings: ShardSettings


@dataclass(frozen=True)
class MakePools:
    cache: CacheConfig


@dataclass(frozen=True)
class ReportMemory:
    pass


@dataclass(frozen=True)
class RunForward:
    batch_args: dict  # keyword arguments of ForwardBatch.build, less the device
    # with rows, batch_args has no page_ids: each row's pages come from the follower's tables
    rows: PagedRows | None = None


@dataclass(frozen=True)
class CommitVerified:
    accepted_lens: list[int]  # per request of the latest VERIFY forward


@dataclass(frozen=True)
class CommitFromLeader:
    rows: int  # the accepted lengths of the latest VERIFY forward's rows follow, broadcast


@dataclass(frozen=True)
class GatherState:
    page_ids: list[int]  # the request's prompt pages, in order
    slot: int | None  # None: the pages' KV only (a chunk before the prompt's last)


@dataclass(frozen=True)
class ScatterState:
    page_ids: list[int]  # where the prompt's pages land, in order
    slot: int


@dataclass(frozen=True)
class Stop:
    pass


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of this rank's CUDA device, after giving back what its allocator
    caches; on the CPU, the host's available and physical memory."""
    from common.engine.pool_sizing import host_figures, release_device

    if torch.device(device).type == "cuda":
        release_device(torch.device(device))
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), int(total)
    figures = host_figures([], device)
    return figures.free_bytes or figures.total_bytes, figures.total_bytes


class FollowerLink:
    """Rank 0's side: broadcasts each message to the followers (a no-op at world size 1).

    An engine keeps one link for its forwards and graph replays: the link records which
    requests' page lists the followers hold (``common/parallel/page_tables.py``)."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        if not tp.is_leader:
            raise ValueError(f"rank {tp.rank} follows; only rank 0 sends to the followers")
        self.tp = tp
        self.tables = LeaderTables()

    def load(self, settings: ShardSettings) -> None:
        self.tp.broadcast_object(LoadModel(settings))

    def make_pools(self, cache: CacheConfig) -> None:
        """Every follower drops its pools and makes them at ``cache``'s sizes (rank 0's)."""
        self.tp.broadcast_object(MakePools(cache))

    def tightest_device(self, free_bytes: int, total_bytes: int) -> tuple[int, int]:
        """The smallest free and the smallest total memory of any rank's device, this one's
        (``free_bytes``, ``total_bytes``) included."""
        self.tp.broadcast_object(ReportMemory())
        free, total = self.tp.min_over_ranks((free_bytes, total_bytes))
        return free, total

    def forward(self, batch_args: dict, tables: list[list[int]] | None = None) -> None:
        """Every follower runs the forward of ``batch_args``. ``tables``: each row's request's
        whole page list (its ``page_ids``), so that only a count of them is sent for lists
        the followers hold already; None sends the pages themselves."""
        if tables is None:
            self.tp.broadcast_object(RunForward(batch_args))
            return
        rows = self.tables.rows(batch_args["state_slots"], tables, batch_args["page_ids"])
        self.tp.broadcast_object(RunForward(
            {k: v for k, v in batch_args.items() if k != "page_ids"}, rows))

    def commit(self, accepted_lens: list[int]) -> None:
        self.tp.broadcast_object(CommitVerified(list(accepted_lens)))

    def commit_from_device(self, lengths: torch.Tensor) -> None:
        """Every follower commits the latest VERIFY forward with ``lengths`` (int64, one per
        row of its padded batch), which stay on the device: broadcast from rank 0's, so
        neither side waits on the host for the acceptance (the greedy commit graphs)."""
        self.tp.broadcast_object(CommitFromLeader(int(lengths.numel())))
        self.tp.broadcast_from_leader(lengths)

    def make_graphs(self, mode: ForwardMode, q_len: int, batch_sizes, capture: bool) -> None:
        """Every follower builds graphs of ``mode`` like rank 0's (``batch_sizes``)."""
        self.tp.broadcast_object(follower_graphs.MakeGraphs(mode, q_len, tuple(batch_sizes),
                                                            capture))

    def capture_graphs(self, mode: ForwardMode, q_len: int) -> None:
        self.tp.broadcast_object(follower_graphs.CaptureGraphs(mode, q_len))

    def replay_graph(self, mode: ForwardMode, q_len: int, starts, page_ids, slots,
                     token_ids, tables: list[list[int]]) -> None:
        """Every follower replays its graph of these rows (``token_ids`` None: the ids are
        broadcast from rank 0's device buffer next); ``tables`` as for :meth:`forward`."""
        # host ints already, as RunForward's: converting each id costs more than pickling
        self.tp.broadcast_object(follower_graphs.ReplayGraph(
            mode, q_len, list(starts), self.tables.rows(slots, tables, page_ids),
            None if token_ids is None else [list(row) for row in token_ids]))

    def stop(self) -> None:
        self.tp.broadcast_object(Stop())

    def send_bands(self, handoff_id: int, plan, page_ids, start: int,
                   slot: int | None) -> None:
        """Every follower sends its bands of pages ``page_ids`` (the prompt's from ``start``)
        and, with ``slot``, of the GDN state, straight to the decode ranks (``plan``); after
        the one with ``slot`` each reports what it sent (``band_messages.sent_key``)."""
        self.tp.broadcast_object(band_messages.SendBands(
            handoff_id, plan, [int(p) for p in page_ids], start, slot))

    def drop_bands(self, handoff_id: int) -> None:
        self.tp.broadcast_object(band_messages.DropBands(handoff_id))

    def open_band_listeners(self, host: str, token: str | None,
                            timeout_s: float = 60.0) -> list[int]:
        """Every follower opens a handoff listener of its own on ``host``; their ports, by
        rank (rank 0's entry is 0: its own listener is the worker's)."""
        self.tp.broadcast_object(band_messages.OpenBandListener(host, token))
        keys = [band_messages.port_key(r) for r in range(1, self.tp.world_size)]
        band_messages.wait_for(self.tp.store, keys, timeout_s)
        return [0] + [int(self.tp.store.get(key)) for key in keys]

    def expect_bands(self, ticket: bytes, page_ids, slot: int, prompt_len: int,
                     page_size: int, src_tp: int) -> None:
        """Every follower takes ``ticket``'s frames into ``page_ids`` and ``slot`` from now on
        (each says so under ``band_messages.ready_key``)."""
        self.tp.broadcast_object(band_messages.ExpectBands(
            ticket, [int(p) for p in page_ids], slot, prompt_len, page_size, src_tp))

    def complete_bands(self, ticket: bytes, frames: tuple[int, ...],
                       idle_timeout_s: float) -> None:
        self.tp.broadcast_object(band_messages.CompleteBands(ticket, tuple(frames),
                                                              idle_timeout_s))

    def forget_bands(self, ticket: bytes) -> None:
        self.tp.broadcast_object(band_messages.ForgetBands(ticket))

    def gather_state(self, model, kv_pool, state_pool, page_ids,
                     slot: int | None) -> PromptState:
        """The full model's state of one request's ``page_ids`` and GDN ``slot`` (None: the
        pages only), on the CPU, every rank's part gathered here. Raises GroupOutOfStep when
        the group fails meanwhile."""
        page_ids = [int(p) for p in page_ids]
        self.tp.broadcast_object(GatherState(page_ids, slot))
        try:
            local = prompt_state.read_from_pools(kv_pool, state_pool, page_ids, slot)
            full = PromptState.zeros_full(model.shard_plan, kv_pool, state_pool, len(page_ids),
                                          with_state=slot is not None)
            return prompt_state.gather_to_leader(self.tp, model.shard_plan, local, full)
        except Exception as exc:
            raise GroupOutOfStep(f"gathering a prompt state failed: {type(exc).__name__}: "
                                 f"{exc}") from exc

    def scatter_state(self, model, kv_pool, state_pool, page_ids, slot: int,
                      full: PromptState) -> None:
        """Land a full-model state of one request on every rank: each writes its part into
        its pools at ``page_ids`` (in order) and ``slot``. Raises GroupOutOfStep when the
        group fails meanwhile."""
        page_ids = [int(p) for p in page_ids]
        self.tp.broadcast_object(ScatterState(page_ids, slot))
        try:
            like = prompt_state.part_like(kv_pool, state_pool, len(page_ids))
            part = prompt_state.scatter_from_leader(self.tp, model.shard_plan, like, full)
            prompt_state.write_to_pools(kv_pool, state_pool, page_ids, slot, part)
        except Exception as exc:
            raise GroupOutOfStep(f"scattering a prompt state failed: {type(exc).__name__}: "
                                 f"{exc}") from exc


class Follower:
    """A follower rank's shard of the model and pools, and the loop that runs rank 0's orders.
    ``bands``: makes the handler of per-rank stream messages (the worker's; None: this
    follower takes none, and one is a TypeError)."""

    def __init__(self, tp: TensorParallelGroup, device: str,
                 bands: BandHandlerFactory | None = None) -> None:
        if tp.is_leader:
            raise ValueError("rank 0 drives; it does not follow")
        self.tp = tp
        self.device = device
        self.model = None
        self.kv_pool = self.state_pool = None
        self.last_batch: ForwardBatch | None = None  # what a CommitVerified refers to
        self.graphs = FollowerGraphs()
        self.tables = FollowerTables()
        self.bands = bands(tp, self) if bands is not None else None

    def run(self) -> None:
        """Handle messages until :class:`Stop`."""
        while True:
            message = self.tp.broadcast_object()
            if isinstance(message, Stop):
                if self.bands is not None:
                    self.bands.close()
                return
            if isinstance(message, LoadModel):
                self.load(message.settings)
            elif isinstance(message, MakePools):
                self.make_pools(message.cache)
            elif isinstance(message, ReportMemory):
                self.tp.min_over_ranks(device_memory(self.device))
            elif isinstance(message, RunForward):
                args = message.batch_args
                if message.rows is not None:
                    args = {**args, "page_ids": self.tables.pages(message.rows)}
                self.forward(args)
            elif isinstance(message, GRAPH_MESSAGES):
                replayed = self.graphs.handle(message, self.model, self.kv_pool,
                                              self.state_pool, self.tables)
                if replayed is not None:
                    self.last_batch = replayed[1]
            elif isinstance(message, CommitVerified):
                self.commit(message.accepted_lens)
            elif isinstance(message, CommitFromLeader):
                lengths = torch.empty(message.rows, dtype=torch.int64, device=self.device)
                self.commit(self.tp.broadcast_from_leader(lengths))
            elif isinstance(message, GatherState):
                self.gather_state(message)
            elif isinstance(message, ScatterState):
                self.scatter_state(message)
            elif isinstance(message, BAND_MESSAGES):
                if self.bands is None:  # rank 0 offered per-rank streams its worker never set up
                    raise TypeError(f"{type(message).__name__}: this follower was started "
                                    "without a band handler")
                self.bands.handle(message)
            else:
                raise TypeError(f"unknown message {type(message).__name__}")

    def load(self, settings: ShardSettings) -> None:
        from common.engine.factory import select_kernel_set
        from common.model.load import load_model

        self.graphs.clear()
        self.model = self.kv_pool = self.state_pool = None  # the old shard goes first
        self.model = load_model(settings.model, dtype=settings.dtype, device=self.device,
                                kernels=select_kernel_set(settings.kernels, self.device),
                                tp=self.tp, expert_parallel=settings.expert_parallel)
        self.kv_pool, self.state_pool = make_pools(self.model, settings.cache, self.device)

    def make_pools(self, cache: CacheConfig) -> None:
        if self.model is None:
            raise RuntimeError("pools before any model was loaded")
        self.graphs.clear()  # they read the old pools
        self.tables.clear()
        self.kv_pool = self.state_pool = self.last_batch = None  # the old pools go first
        if torch.device(self.device).type == "cuda":
            from common.engine.pool_sizing import release_device

            release_device(torch.device(self.device))
        self.kv_pool, self.state_pool = make_pools(self.model, cache, self.device)

    def forward(self, batch_args: dict) -> None:
        if self.model is None:
            raise RuntimeError("a forward before any model was loaded")
        batch = ForwardBatch.build(**batch_args, device=self.device)
        if batch.mode == ForwardMode.EXTEND:
            # NOTE: rank 0 zeroes a slot when it allocates it; a follower allocates nothing, so
            # it zeroes the slot of every request that starts from no cached token instead
            fresh = [slot for slot, p in zip(batch.state_slots.tolist(), batch.prefix_lens)
                     if p == 0]
            if fresh:
                self.state_pool.conv[:, fresh] = 0
                self.state_pool.ssm[:, fresh] = 0
        self.model(batch, kv_pool=self.kv_pool, state_pool=self.state_pool)
        self.last_batch = batch

    def gather_state(self, message: GatherState) -> None:
        local = prompt_state.read_from_pools(self.kv_pool, self.state_pool, message.page_ids,
                                             message.slot)
        prompt_state.gather_to_leader(self.tp, self.model.shard_plan, local)

    def scatter_state(self, message: ScatterState) -> None:
        like = prompt_state.part_like(self.kv_pool, self.state_pool, len(message.page_ids))
        part = prompt_state.scatter_from_leader(self.tp, self.model.shard_plan, like)
        prompt_state.write_to_pools(self.kv_pool, self.state_pool, message.page_ids,
                                    message.slot, part)

    def commit(self, accepted_lens: list[int] | torch.Tensor) -> None:
        if self.last_batch is None or self.last_batch.mode != ForwardMode.VERIFY:
            raise RuntimeError("a commit without a VERIFY forward before it")
        self.model.commit_verified(self.last_batch, accepted_lens, state_pool=self.state_pool)
