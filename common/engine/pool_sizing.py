"""A worker's pools at start-up: fixed sizes, or sized by ``--mem-fraction`` from measurements.

On a CUDA device the measurement is a profile run, as vLLM profiles before it allocates its KV
cache: an engine with a small pool captures its CUDA graphs and prefills one full chunk; its
peak (torch's reserved memory) less that pool is what the worker holds besides its pools. What a
page and a slot cost is measured too, as the growth of a freshly built engine per page and per
slot, so per-page index buffers (graph attention plans, the draft's page table) are counted. The
profile engine is then dropped and the real one built, so graphs are captured twice at start-up.

On the CPU nothing is profiled: the budget is a fraction of physical memory, and what the worker
holds besides its pools is taken to be its weights (activations are not counted).

With tensor parallelism rank 0 sizes for every rank: ranks hold equal shards, and rank 0 the
most (the draft and its vocabulary live there only), so its measurements bound each rank's. Its
followers take part through ``tightest_device``: they profile on small pools with it, report
their device's free and total memory (the tightest device sets the figures), and then make
pools of the size chosen. On the CPU the ranks share one host: each is given ``1/N`` of the
budget and of the memory free once every rank has loaded.

The arithmetic is ``common/cache/sizing.py``; the rule is in docs/operations.md.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from collections.abc import Callable
from dataclasses import replace

import torch

from common.cache.sizing import (MemoryFigures, PoolCosts, PoolRequest, PoolSizing,
                                 fixed_pools, format_bytes, size_pools)
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine, make_pools
from common.model.dflash import DFlashDraftModel, DraftKVPool
from common.model.qwen3_5 import HybridForCausalLM
from common.sampling import SamplingParams

log = logging.getLogger(__name__)

# Set aside on a CUDA device for what torch's allocator does not see: the CUDA context, the
# kernels' code (Triton, FlashInfer), driver-side buffers.
CUDA_RESERVE_BYTES = 1 << 30
# pages and slots added to measure what one more of each costs
_EXTRA_PAGES, _EXTRA_SLOTS = 1024, 16
_PROFILE_SLOTS = 2


def min_pages(config: EngineConfig) -> int:
    """The fewest pages a sized pool may have (and the profile pool has): one full prefill
    chunk with room to spare, plus the scratch page."""
    cache, scheduler = config.cache, config.scheduler
    return 2 + math.ceil((scheduler.max_prefill_tokens + 256) / cache.page_size)


def profile_cache(config: EngineConfig) -> CacheConfig:
    """The small pools a profile runs on (and a follower holds until rank 0 has sized)."""
    return replace(config.cache, num_pages=min_pages(config), num_slots=_PROFILE_SLOTS)


def size_engine_pools(model: HybridForCausalLM, config: EngineConfig, request: PoolRequest, *,
                      draft: DFlashDraftModel | None = None, block_size: int | None = None,
                      eos_token_ids: tuple[int, ...] = (), progress: bool = True,
                      held_bytes: int = 0, world_size: int = 1,
                      tightest_device: Callable[[int, int], tuple[int, int]] | None = None
                      ) -> tuple[EngineConfig, PoolSizing]:
    """``config`` with the pools ``request`` asks for, and how they were chosen.

    ``held_bytes``: on the CPU, what the worker holds beside the model's and the draft's
    tensors (rank 0's copy of the whole vocabulary for the draft; a CUDA profile measures it).
    ``world_size`` and ``tightest_device`` (rank 0 of a tensor-parallel group, the followers
    on :func:`profile_cache` pools): ``(free, total) -> (free, total)``, the smallest over
    every rank's device.

    Raises SizingError (what to change) when ``request.mem_fraction`` cannot hold the pools.
    """
    if world_size > 1 and tightest_device is None:
        raise ValueError("sizing for a tensor-parallel group needs its ranks' memory")
    costs = pool_costs(model, draft, config.cache.page_size)
    device = torch.device(config.device)
    if request.mem_fraction is None:
        sizing = fixed_pools(costs, request)
    elif device.type == "cuda":
        def build(cache: CacheConfig) -> LLMEngine:
            return LLMEngine(model, replace(config, cache=cache), eos_token_ids, draft=draft,
                             block_size=block_size)
        sizing = _size_on_cuda(build, config, request, costs, progress, tightest_device)
    else:
        figures = host_figures([model, draft], str(device))
        figures = replace(figures, fixed_bytes=figures.fixed_bytes + held_bytes)
        if world_size > 1:
            figures = host_share(figures, world_size, tightest_device)
        sizing = size_pools(costs, figures, request)
    cache = replace(config.cache, num_pages=sizing.num_pages, num_slots=sizing.num_slots)
    return replace(config, cache=cache), sizing


def pool_costs(model: HybridForCausalLM, draft: DFlashDraftModel | None,
               page_size: int) -> PoolCosts:
    """What the pool tensors themselves cost per page and per slot (made on the meta device,
    so nothing is allocated)."""
    kv, state = make_pools(model, CacheConfig(page_size=page_size, num_pages=2, num_slots=2),
                           "meta")
    kv_page = kv.kv[:, 0].numel() * kv.kv.element_size()
    draft_page = 0
    if draft is not None:
        draft_page = DraftKVPool.like(kv, draft.config).bytes_per_token() * page_size
    conv_slot = state.conv[:, 0].numel() * state.conv.element_size()
    ssm_slot = state.ssm[:, 0].numel() * state.ssm.element_size()
    return PoolCosts(page_bytes=max(1, kv_page + draft_page),
                     slot_bytes=max(1, conv_slot + ssm_slot),
                     page_tensor_bytes=max(kv_page, draft_page),
                     slot_tensor_bytes=max(conv_slot, ssm_slot))


def host_figures(modules: list[torch.nn.Module | None], device: str) -> MemoryFigures:
    """The host's memory, for a worker on the CPU: physical memory, what is available now,
    and the weights of ``modules``."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return MemoryFigures(device=device, total_bytes=total, free_bytes=_available_host_bytes(),
                         fixed_bytes=sum(tensor_bytes(m) for m in modules if m is not None))


def host_share(figures: MemoryFigures, world_size: int,
               tightest_device: Callable[[int, int], tuple[int, int]]) -> MemoryFigures:
    """One rank's share of a host whose ``world_size`` ranks hold alike: ``1/N`` of its memory
    and of what is free once every rank has loaded (``tightest_device`` waits for them)."""
    free, total = tightest_device(figures.free_bytes or figures.total_bytes,
                                  figures.total_bytes)
    return replace(figures, device=f"{figures.device} (1/{world_size} of the host per rank)",
                   total_bytes=total // world_size, free_bytes=free // world_size)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a tensor shared by two names counted once)."""
    return storage_bytes([*module.parameters(), *module.buffers()])


def storage_bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each counted once (tied weights, views)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def profile_prefill(engine: LLMEngine) -> None:
    """Prefill one prompt of a full chunk (``max_prefill_tokens``), the largest eager forward a
    worker runs, and drop it."""
    n = engine.config.scheduler.max_prefill_tokens
    vocab = engine.model.config.vocab_size
    key = "__profile__"
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    engine.add_request([1 + i % (vocab - 1) for i in range(n)], params, request_id=key)
    while key in engine.requests and engine.has_work():
        if any(e.held for e in engine.step()):
            break
    engine.abort(key)  # a prefill worker holds it for a handoff


def _size_on_cuda(build: Callable[[CacheConfig], LLMEngine], config: EngineConfig,
                  request: PoolRequest, analytic: PoolCosts, progress: bool,
                  tightest_device: Callable[[int, int], tuple[int, int]] | None = None
                  ) -> PoolSizing:
    device = torch.device(config.device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    small = profile_cache(config)
    log.info("sizing the pools for --mem-fraction %g: profiling an engine with %d pages and "
             "%d slots", request.mem_fraction, small.num_pages, small.num_slots)
    costs = _measured_costs(build, small, analytic, device)
    release_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine = build(small)
    engine.warmup(progress=progress)
    profile_prefill(engine)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    del engine
    release_device(device)
    fixed = peak - small.num_pages * costs.page_bytes - small.num_slots * costs.slot_bytes
    free, total = torch.cuda.mem_get_info(device)
    if tightest_device is not None:
        free, total = tightest_device(free, total)
    # the real engine takes its graphs and activations from the same free memory as its pools
    still_to_take = max(0, fixed - torch.cuda.memory_reserved(device))
    figures = MemoryFigures(device=str(device), total_bytes=total,
                            free_bytes=max(0, free - still_to_take), fixed_bytes=fixed,
                            reserve_bytes=CUDA_RESERVE_BYTES)
    torch.cuda.reset_peak_memory_stats(device)  # check_fit measures the real engine alone
    return size_pools(costs, figures, request)


def _measured_costs(build: Callable[[CacheConfig], LLMEngine], small: CacheConfig,
                    analytic: PoolCosts, device: torch.device) -> PoolCosts:
    """Bytes per page and per slot as a built engine grows with them (never below the pool
    tensors' own)."""
    base = _construction_bytes(build, small, device)
    pages = _construction_bytes(
        build, replace(small, num_pages=small.num_pages + _EXTRA_PAGES), device)
    slots = _construction_bytes(
        build, replace(small, num_slots=small.num_slots + _EXTRA_SLOTS), device)
    return replace(analytic,
                   page_bytes=max(analytic.page_bytes, math.ceil((pages - base) / _EXTRA_PAGES)),
                   slot_bytes=max(analytic.slot_bytes, math.ceil((slots - base) / _EXTRA_SLOTS)))


def _construction_bytes(build: Callable[[CacheConfig], LLMEngine], cache: CacheConfig,
                        device: torch.device) -> int:
    release_device(device)
    before = torch.cuda.memory_allocated(device)
    engine = build(cache)
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_allocated(device) - before
    del engine
    return used


def release_device(device: torch.device) -> None:
    """Free what dropped engines or pools held (graphs' pools included) back to a CUDA
    device."""
    gc.collect()  # an engine's graph runners and speculator refer to each other
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def check_fit(engine: LLMEngine, sizing: PoolSizing) -> None:
    """After warm-up, on a CUDA device with pools sized to a budget: prefill one full chunk and
    log the peak measured against the budget (a warning when above it)."""
    device = engine.kv_pool.kv.device
    budget = sizing.budget_bytes
    if device.type != "cuda" or budget is None or sizing.request.num_pages is not None:
        return
    profile_prefill(engine)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) + sizing.figures.reserve_bytes
    message = (f"memory: peak {format_bytes(peak)} (torch's reserved peak and "
               f"{format_bytes(sizing.figures.reserve_bytes)} set aside) of a "
               f"{format_bytes(budget)} budget ({100 * peak / budget:.1f}%)")
    if peak > budget:
        log.warning("%s: above the budget; lower --mem-fraction or give --num-pages", message)
    else:
        log.info("%s", message)
