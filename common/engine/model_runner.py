"""Turns a scheduled step into a model forward over the pools; owns the device side."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool
from common.engine.cuda_graph import GraphRunner
from common.engine.errors import GroupOutOfStep
from common.engine.layer_progress import LayerProgress
from common.engine.scheduler import ScheduledStep
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.qwen3_5 import HybridForCausalLM, ModelOutput

if TYPE_CHECKING:
    from common.parallel.followers import FollowerLink


class ModelRunner:
    """Args:
        graphs: replays DECODE steps it serves from CUDA graphs; others run eagerly.
        followers: on rank 0 of a tensor-parallel model, the engine's one link to the other
            ranks (``common/parallel/followers.py``), shared with its graph runners: the link
            records which page lists the followers hold, so there must be only one.

    On rank 0 of a tensor-parallel model every forward is first sent to the followers, which
    run the same batch on their shards (a graph replay is sent by the graph runner itself).
    """

    def __init__(self, model: HybridForCausalLM, kv_pool: KVPool, state_pool: GDNStatePool,
                 device: torch.device | str, graphs: GraphRunner | None = None,
                 followers: FollowerLink | None = None) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = torch.device(device)
        self.graphs = graphs
        self.followers = None
        if model.tp.world_size > 1:
            if followers is None:
                raise ValueError("a tensor-parallel model's runner needs rank 0's link to its "
                                 "followers")
            if graphs is not None and graphs.followers is not followers:
                raise ValueError("a tensor-parallel model's graphs need the runner's link to "
                                 "its followers, or a replay would not reach them in step")
            self.followers = followers

    def batch_args(self, step: ScheduledStep, *, return_all_logits: bool = False) -> dict:
        """``ForwardBatch.build``'s arguments for ``step`` (all host values), less the device."""
        reqs = step.requests
        return dict(
            mode=step.mode, token_ids=step.token_ids(),
            prefix_lens=[r.num_cached for r in reqs],
            page_ids=[r.page_ids[:self.kv_pool.pages_for(r.num_cached + n)]
                      for r, n in zip(reqs, step.num_new_tokens)],
            page_size=self.kv_pool.page_size, state_slots=[r.slot for r in reqs],
            return_all_logits=return_all_logits)

    def build_batch(self, step: ScheduledStep, *, return_all_logits: bool = False) -> ForwardBatch:
        return ForwardBatch.build(**self.batch_args(step, return_all_logits=return_all_logits),
                                  device=self.device)

    def forward(self, batch_args: dict, *, after_layer=None,
                tables: list[list[int]] | None = None) -> tuple[ModelOutput, ForwardBatch]:
        """One eager forward of the batch ``ForwardBatch.build(**batch_args)`` over the pools
        (sent to the followers first, once the build has accepted it). ``tables``: each row's
        request's whole page list, so the followers are sent only the lists they lack
        (``FollowerLink.forward``)."""
        batch = ForwardBatch.build(**batch_args, device=self.device)
        if self.followers is None:
            out = self.model(batch, kv_pool=self.kv_pool, state_pool=self.state_pool,
                             after_layer=after_layer)
            return out, batch
        self.followers.forward(batch_args, tables)
        try:
            out = self.model(batch, kv_pool=self.kv_pool, state_pool=self.state_pool,
                             after_layer=after_layer)
        except Exception as exc:
            raise GroupOutOfStep(f"a tensor-parallel forward failed on rank 0 after the "
                                 f"followers were sent it: {type(exc).__name__}: {exc}") from exc
        return out, batch

    def commit_verified(self, batch: ForwardBatch, accepted_lens) -> None:
        """``HybridForCausalLM.commit_verified`` of the latest VERIFY forward, on every rank
        (the followers are sent the accepted lengths, as host ints)."""
        if self.followers is None:
            self.model.commit_verified(batch, accepted_lens, state_pool=self.state_pool)
            return
        lengths = [int(n) for n in (accepted_lens.tolist() if torch.is_tensor(accepted_lens)
                                    else accepted_lens)]
        self.followers.commit(lengths)
        try:
            self.model.commit_verified(batch, lengths, state_pool=self.state_pool)
        except Exception as exc:
            raise GroupOutOfStep(f"a tensor-parallel commit failed on rank 0 after the "
                                 f"followers were sent it: {type(exc).__name__}: {exc}") from exc

    def run(self, step: ScheduledStep, *, return_all_logits: bool = False,
            after_layer=None) -> tuple[ModelOutput, ForwardBatch]:
        """Run one forward and advance every request's ``num_cached``. ``after_layer(i)``:
        called once layer ``i``'s work is queued, in an eager forward (not a graph replay)."""
        if (self.graphs is not None and step.mode == ForwardMode.DECODE
                and not return_all_logits and self.graphs.serves(len(step.requests))):
            out, batch = self.graphs.run(step.requests, step.token_ids())
        else:
            out, batch = self.forward(self.batch_args(step, return_all_logits=return_all_logits),
                                      after_layer=after_layer,
                                      tables=[r.page_ids for r in step.requests])
        for r, n in zip(step.requests, step.num_new_tokens):
            r.num_cached += n
        return out, batch

    def run_reporting(self, step: ScheduledStep,
                      on_start: Callable[[ScheduledStep, LayerProgress], None]):
        """``run``, first handing ``on_start`` the forward's :class:`LayerProgress`, which is
        told as each model layer is queued (and when the forward is done, or raised), so that
        readers of a layer's state wait for that layer only."""
        progress = LayerProgress(self.model.config.num_hidden_layers, self.device.type == "cuda")
        on_start(step, progress)
        try:
            out, batch = self.run(step, after_layer=progress.layer_queued)
        except BaseException as exc:
            progress.fail(exc)
            raise
        progress.finish()
        return out, batch

