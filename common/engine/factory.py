"""One way to build an engine: the model, its optional DFLASH draft, the pools and the CUDA
graphs, from :class:`EngineSettings`.

Both workers, ``flashsplit generate`` and ``flashsplit demo`` build through
:func:`build_engine`. Each turns its own flags into settings first, so nothing here reads a
command line, and nothing outside this module loads a model to serve it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from common.cache.sizing import PoolRequest, PoolSizing, format_bytes
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.handoff.layout import LayoutDescriptor

log = logging.getLogger(__name__)

# "always": every path runs once so kernels compile and autotune before a worker reports
# SERVING; "graphs": only where there are CUDA graphs to capture (a one-shot run would pay for
# compiling the rest anyway)
WARMUP_POLICIES = ("always", "graphs")


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from.

    Attributes:
        model: a checkpoint directory or a built-in name (``common/model/registry.py``).
        draft: a DFLASH draft, ``'tiny'`` or a checkpoint directory; None for none.
        block_size: tokens per DFLASH step (None: the draft's own).
        dtype: the weights' dtype (None: the config's).
        kernels: a kernel set (``docs/kernels.md``), or ``'auto'`` (on a CUDA device
            ``'gpu'``, or ``'gpu-triton-attention'`` for a decode engine with a draft or
            without FlashInfer; else ``'cpu'``); None leaves the model its default kernels
            (the reference).
        engine: the engine's cache, scheduler, graph and device settings; its pool sizes are
            used as given unless ``pools`` sizes them.
        pools: what the pool flags ask for (``--mem-fraction``, ``--num-pages``,
            ``--num-slots``), sized by ``common/engine/pool_sizing.py``; None for none.
        warmup: one of :data:`WARMUP_POLICIES`.
        progress: progress bars for weight loading and graph capture (terminals only).
        tensor_parallel_size: ranks the model is sharded over; above 1, :func:`build_engine`
            takes rank 0's group, and the followers load their shards when it does.
        expert_parallel: place a MoE model's routed experts whole on the ranks, instead of
            splitting each expert's matrices over them.
    """

    model: str
    draft: str | None = None
    block_size: int | None = None
    dtype: torch.dtype | None = None
    kernels: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    pools: PoolRequest | None = None
    warmup: str = "graphs"
    progress: bool = False
    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.warmup not in WARMUP_POLICIES:
            raise ValueError(f"warmup must be one of {WARMUP_POLICIES}, got {self.warmup!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got "
                             f"{self.tensor_parallel_size}")


@dataclass(frozen=True)
class BuiltEngine:
    """An engine with what its callers need beside it.

    Attributes:
        engine: the engine, warmed up as the settings asked.
        layout: the handoff layout of its pools (prefill and decode must agree on it).
        fingerprint: the model's handoff fingerprint (architecture and weights).
        eos_token_ids: the end-of-sequence ids the engine stops at.
        sizing: how the pools were sized, when ``EngineSettings.pools`` asked.
    """

    engine: LLMEngine
    layout: LayoutDescriptor
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    sizing: PoolSizing | None = None


def build_engine(settings: EngineSettings, *, tp=None) -> BuiltEngine:
    """Load the model (and draft), size the pools, build and warm up the engine.

    ``tp``: rank 0's :class:`~common.parallel.group.TensorParallelGroup` when
    ``settings.tensor_parallel_size`` is above 1 (``common/parallel/launch.py`` makes one); the
    followers are told to load their shards first, so all ranks load at once.

    Raises SizingError (what to change) when ``settings.pools`` cannot fit, ValueError for a
    kernel set whose libraries are missing or a group that does not match the settings,
    ShardingError when the model does not split over the group, FileNotFoundError for a model
    that is not there.
    """
    from common.engine.pool_sizing import (check_fit, profile_cache, size_engine_pools,
                                           storage_bytes)
    from common.handoff.layout import model_fingerprint
    from common.model.dflash import load_draft
    from common.model.load import eos_token_ids_for, load_model, weights_identity

    config = settings.engine
    world_size = 1 if tp is None else tp.world_size
    if world_size != settings.tensor_parallel_size:
        raise ValueError(f"the settings ask for tensor-parallel size "
                         f"{settings.tensor_parallel_size}, the group given has {world_size}")
    if world_size > 1:
        from common.model.registry import load_config
        from common.parallel.followers import FollowerLink, ShardSettings
        from common.parallel.shard_plan import ShardPlan

        # the split is checked here, once, before any rank starts to load
        ShardPlan.for_rank(load_config(settings.model), 0, world_size,
                           expert_parallel=settings.expert_parallel)
        # pools to be sized: the followers start on small ones, and make the chosen ones after
        follower_cache = config.cache if settings.pools is None else profile_cache(config)
        FollowerLink(tp).load(ShardSettings(settings.model, settings.dtype, settings.kernels,
                                            follower_cache, settings.expert_parallel))
        log.info("tensor parallel over %d ranks%s", world_size,
                 ", routed experts placed whole (expert parallel)" if settings.expert_parallel
                 else "")
    # a draft's decode engine on one GPU; the prefill side (which holds requests after
    # prefill) and tensor-parallel ranks, which launch no step ahead, keep the plain choice
    speculative_decode = bool(settings.draft) and not config.hold_after_prefill \
        and world_size == 1
    model = load_model(settings.model, dtype=settings.dtype, device=config.device,
                       kernels=select_kernel_set(settings.kernels, config.device,
                                                 speculative_decode=speculative_decode),
                       progress=settings.progress, tp=tp,
                       expert_parallel=settings.expert_parallel)
    draft = load_draft(settings.draft, model) if settings.draft else None
    draft_vocab = None
    if draft is not None and world_size > 1:
        from common.model.load import full_vocabulary

        # the draft runs on rank 0 only and reads the whole vocabulary's rows
        draft_vocab = full_vocabulary(settings.model, model.config, dtype=model.dtype,
                                      device=config.device)
    eos = eos_token_ids_for(settings.model, model.config)
    sizing = None
    if settings.pools is not None:
        link = FollowerLink(tp) if world_size > 1 else None
        config, sizing = size_engine_pools(
            model, config, settings.pools, draft=draft, block_size=settings.block_size,
            eos_token_ids=eos, progress=settings.progress,
            held_bytes=storage_bytes(draft_vocab or ()),
            world_size=world_size, tightest_device=link.tightest_device if link else None)
        log.info("%s", sizing.describe())
        if link is not None:
            link.make_pools(config.cache)
        if sizing.over_budget_bytes:
            log.warning("the pools given exceed the --mem-fraction budget by %s",
                        format_bytes(sizing.over_budget_bytes))
    engine = LLMEngine(model, config, eos, draft=draft, block_size=settings.block_size,
                       draft_vocab=draft_vocab)
    if settings.warmup == "always" or engine.runner.graphs is not None:
        start = time.perf_counter()
        engine.warmup(settings.progress)
        log.info("warm-up took %.1f s", time.perf_counter() - start)
    if sizing is not None:
        check_fit(engine, sizing)
    layout = LayoutDescriptor.from_model(model.config, config.cache.page_size, model.dtype)
    fingerprint = model_fingerprint(model.config, weights_identity(settings.model))
    return BuiltEngine(engine, layout, fingerprint, engine.eos_token_ids, sizing)


def select_kernel_set(name: str | None, device: str, *, speculative_decode: bool = False):
    """The model's kernels for set ``name`` on ``device`` (logged once); None for the model's
    default. ``auto`` takes the first of its sets whose libraries load (:func:`choose_kernel_set`);
    a named set that cannot load is a ValueError."""
    if name is None:
        return None
    return choose_kernel_set(name, device, speculative_decode=speculative_decode)[1]


def choose_kernel_set(name: str, device: str, *, speculative_decode: bool = False):
    """``(set name, kernels)`` for set ``name`` on ``device``: for ``auto`` the first of its sets
    whose libraries load, saying why it passed over any (``speculative_decode``: an engine that
    decodes with a draft on one GPU, ``common.ops.gpu_backends.sets_for_device``); a named set
    that cannot load is a ValueError."""
    from common.model import kernels as model_kernels
    from common.ops.gpu_backends import describe, sets_for_device

    choices = sets_for_device(name, device, speculative_decode=speculative_decode)
    for i, chosen in enumerate(choices):
        try:
            kernels = model_kernels.select_kernels(chosen)
        except ValueError as exc:
            if i + 1 == len(choices):
                raise
            log.warning("kernels %s unavailable, taking %s: %s", chosen, choices[i + 1], exc)
            continue
        log.info("kernels %s", describe(chosen))
        return chosen, kernels
