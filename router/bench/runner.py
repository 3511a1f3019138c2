"""Running the load points of a benchmark, one after the other, with a progress bar each."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from router.bench.backends import GrpcBackend, OpenAIBackend, RequestResult, make_backend
from router.bench.config import BenchConfig, Load
from router.bench.metrics import Summary, summarize
from router.bench.workload import BenchRequest, arrival_offsets, build_requests


@dataclass(frozen=True)
class LoadPoint:
    """One load point's outcome."""

    load: Load
    summary: Summary
    results: tuple[RequestResult, ...]


@dataclass(frozen=True)
class BenchReport:
    config: BenchConfig
    model: str
    points: tuple[LoadPoint, ...]


async def run_point(backend: GrpcBackend | OpenAIBackend, requests: Sequence[BenchRequest],
                    load: Load, config: BenchConfig) -> LoadPoint:
    """Send ``requests`` at ``load``; returns when every one has answered."""
    limit = load.concurrency or config.max_concurrency
    slots = asyncio.Semaphore(limit) if limit else None
    offsets = arrival_offsets(len(requests), load.request_rate, config.seed)
    bar = tqdm(total=len(requests), desc=load.label, unit="req", file=sys.stderr,
               disable=not config.progress, leave=False)
    start = time.perf_counter()

    async def one(req: BenchRequest) -> RequestResult:
        if slots is not None:
            async with slots:
                return await timed(req)
        return await timed(req)

    async def timed(req: BenchRequest) -> RequestResult:
        sent = time.perf_counter() - start
        result = await backend.send(req)
        result.start_s = sent
        bar.update(1)
        return result

    tasks = []
    try:
        for offset, req in zip(offsets, requests):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    duration = time.perf_counter() - start
    return LoadPoint(load, summarize(results, duration), tuple(results))


async def run_bench(config: BenchConfig) -> BenchReport:
    """Warm up, then run every load point of ``config`` on the same requests."""
    backend = make_backend(config)
    try:
        model = await backend.model_name()
        requests = build_requests(config)
        for req in requests[:config.warmup]:
            result = await backend.send(req)
            if not result.ok:
                raise RuntimeError(f"the warm-up request failed: {result.error}")
        points = [await run_point(backend, requests, load, config) for load in config.loads]
    finally:
        await backend.close()
    return BenchReport(config, model, tuple(points))
