"""On one GPU: router + prefill + decode (both workers on the same device) serving a
Qwen3.5-4B-shaped model with random weights give the single-process engine's greedy tokens,
with and without DFLASH, over both handoff transports (``auto``: device-to-device copies out of
the prefill worker's pools; ``stream``: the byte stream, each layer read as its forward ends),
long prompts in chunks; every page and slot is free afterwards."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.decode import build
from benchmarks.shapes import QWEN3_5_4B, QWEN3_5_4B_DRAFT
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.load import load_model
from common.model.registry import load_config
from common.model.kernels import select_kernels
from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import wait_all_free, worker_load

pytestmark = pytest.mark.gpu

PROMPTS = [[(37 * i + 11) % 240000 for i in range(n)] for n in (5, 16, 300)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
# the 300-token prompt runs as three chunks on both sides: the handoff streams chunk by chunk
MAX_PREFILL_TOKENS = 128


def save_checkpoint(module: torch.nn.Module, config: dict, path) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
              str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-ckpt")
    target, draft = build("gpu", with_draft=True)
    target_path = save_checkpoint(target, dict(QWEN3_5_4B), root / "target")
    draft_path = save_checkpoint(draft, dict(QWEN3_5_4B_DRAFT), root / "draft")
    del target, draft
    torch.cuda.empty_cache()
    return target_path, draft_path


def single_process(target_path: str, draft_path: str | None) -> list[list[int]]:
    model = load_model(target_path, device="cuda", kernels=select_kernels("gpu"))
    draft = load_draft(draft_path, model) if draft_path else None
    engine = LLMEngine(model, EngineConfig(
        device="cuda", scheduler=SchedulerConfig(max_prefill_tokens=MAX_PREFILL_TOKENS)),
        draft=draft)
    engine.warmup()  # captures the CUDA graphs, as the decode worker does: the same kernels
    # one request at a time, as the cluster test sends them: the same batches on both sides
    out = [engine.generate([p], GREEDY)[0].output_ids for p in PROMPTS]
    del engine, model, draft
    torch.cuda.empty_cache()
    return out


async def one_by_one(address: str) -> list:
    return [await generate(address, request_to_pb(token_ids=p, params=GREEDY), timeout_s=300)
            for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(checkpoints):
    """``expected(speculative)``: the single-process tokens, computed once for both
    transports."""
    target_path, draft_path = checkpoints
    cache = {}

    def tokens(speculative: bool) -> list[list[int]]:
        if speculative not in cache:
            cache[speculative] = single_process(target_path,
                                                draft_path if speculative else None)
        return cache[speculative]

    return tokens


@pytest.mark.parametrize("transport", ["auto", "tcp", "stream"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_cluster_on_one_gpu_matches_single_process(checkpoints, expected, speculative,
                                                   transport):
    target_path, draft_path = checkpoints
    args = ("--device", "cuda", "--kernels", "gpu", "--num-slots", "9", "--num-pages", "512",
            "--max-prefill-tokens", str(MAX_PREFILL_TOKENS), "--handoff-transport", transport)
    if speculative:
        args += ("--draft", draft_path)
    want = expected(speculative)  # before the cluster takes the GPU's memory
    with Cluster(ClusterConfig(model=target_path, worker_args=args)) as cluster:
        outs = asyncio.run(one_by_one(cluster.router_address))
        reports = asyncio.run(wait_all_free(cluster))
        (prefill_worker,) = [w for w in cluster.workers if w.kind == "prefill"]
        load = asyncio.run(worker_load(prefill_worker.address, "prefill",
                                       cluster.internal_token))
    assert [o.token_ids for o in outs] == want
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)
    copied = load.counters.get("handoffs_as_pool_copies", 0)
    assert copied == (len(PROMPTS) if transport == "auto" else 0)
    assert load.counters.get("handoffs_over_tcp", 0) == (len(PROMPTS) if transport == "tcp"
                                                         else 0)
    if speculative:
        assert all(o.accept_lengths for o in outs)
    assert load_config(target_path).hidden_size == 2560
