"""On the GPU: pools sized by --mem-fraction fit the budget they were sized for (measured after
a full prefill chunk, with the CUDA graphs captured), and `flashsplit up`'s split lets a prefill
and a decode worker on one GPU stay within their shares together.

Run: ``python -m pytest -q -m gpu tests/common/engine/test_pool_sizing_gpu.py``
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from benchmarks.decode import build
from benchmarks.ttft import random_checkpoint
from common.cache.sizing import DEFAULT_NUM_PAGES, PoolRequest
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.engine.pool_sizing import (CUDA_RESERVE_BYTES, min_pages, profile_prefill,
                                       size_engine_pools)
from common.engine.scheduler import SchedulerConfig
from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc
from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb

pytestmark = pytest.mark.gpu

RUNNING = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def test_sized_pools_and_the_rest_fit_the_budget():
    model, draft = build("gpu", with_draft=True)
    config = EngineConfig(device="cuda",
                          scheduler=SchedulerConfig(max_running_requests=RUNNING),
                          cuda_graph=CudaGraphConfig(max_batch_size=RUNNING))
    request = PoolRequest(mem_fraction=0.3, default_slots=RUNNING + 1,
                          min_pages=min_pages(config))
    sized, sizing = size_engine_pools(model, config, request, draft=draft, progress=False)
    engine = LLMEngine(model, sized, draft=draft)
    engine.warmup(progress=False)
    profile_prefill(engine)
    out = engine.generate([[(37 * i + 11) % 240000 for i in range(300)]], GREEDY)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() + CUDA_RESERVE_BYTES
    budget = sizing.budget_bytes
    assert peak <= budget, sizing.describe()
    # the room left after the weights, graphs and activations went to the pools
    room = budget - sizing.figures.fixed_bytes - CUDA_RESERVE_BYTES
    assert 0 <= room - sizing.pool_bytes < sizing.costs.page_bytes, sizing.describe()
    assert engine.kv_pool.num_pages == sizing.num_pages > DEFAULT_NUM_PAGES
    assert engine.state_pool.num_slots == RUNNING + 1
    assert len(out[0].output_ids) == GREEDY.max_new_tokens
    del engine, model, draft
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("sized-ckpt"))


async def serve_and_list(address: str):
    out = await generate(address, request_to_pb(token_ids=list(range(1, 200)), params=GREEDY),
                         timeout_s=300)
    async with grpc.aio.insecure_channel(address) as channel:
        workers = await generation_pb2_grpc.GenerationStub(channel).ListWorkers(
            generation_pb2.ListWorkersRequest(), timeout=10)
    return out, workers


def test_up_splits_one_gpu_between_its_prefill_and_decode_worker(checkpoint):
    fraction = 0.5
    free_before, total = torch.cuda.mem_get_info()
    args = ("--device", "cuda", "--kernels", "gpu", "--max-running-requests", str(RUNNING),
            "--cuda-graph-max-bs", str(RUNNING))
    with Cluster(ClusterConfig(model=checkpoint, worker_args=args,
                               mem_fraction=fraction)) as cluster:
        out, workers = asyncio.run(serve_and_list(cluster.router_address))
        free, _ = torch.cuda.mem_get_info()  # after serving: activations stay cached
        logs = [w.stderr_tail(200) for w in cluster.workers]
    # both workers together, CUDA contexts included, within the fraction they were given
    assert free_before - free <= fraction * total
    assert len(out.token_ids) == GREEDY.max_new_tokens
    assert len(workers.workers) == 2
    assert all(w.HasField("load") and w.load.total_pages > DEFAULT_NUM_PAGES
               for w in workers.workers)
    for log in logs:
        assert f"--mem-fraction {fraction / 2:g} of" in log, log
