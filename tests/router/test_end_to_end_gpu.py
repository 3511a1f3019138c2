"""On one GPU: router + prefill + decode (both workers on the same device) serving a
Qwen3.5-4B-shaped model with random weights give the single-process engine's greedy tokens,
with and without DFLASH."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.decode import build
from benchmarks.shapes import QWEN3_5_4B, QWEN3_5_4B_DRAFT
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.model.dflash import load_draft
from common.model.load import load_config, load_model
from common.ops.gpu_backends import select_kernels
from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb

pytestmark = pytest.mark.gpu

PROMPTS = [[(37 * i + 11) % 240000 for i in range(n)] for n in (5, 16, 300)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


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
    engine = LLMEngine(model, EngineConfig(device="cuda"), draft=draft)
    engine.warmup()  # captures the CUDA graphs, as the decode worker does: the same kernels
    # one request at a time, as the cluster test sends them: the same batches on both sides
    out = [engine.generate([p], GREEDY)[0].output_ids for p in PROMPTS]
    del engine, model, draft
    torch.cuda.empty_cache()
    return out


async def one_by_one(address: str) -> list:
    return [await generate(address, request_to_pb(token_ids=p, params=GREEDY), timeout_s=300)
            for p in PROMPTS]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_cluster_on_one_gpu_matches_single_process(checkpoints, speculative):
    target_path, draft_path = checkpoints
    expected = single_process(target_path, draft_path if speculative else None)
    args = ("--device", "cuda", "--kernels", "gpu", "--num-slots", "9", "--num-pages", "512")
    if speculative:
        args += ("--draft", draft_path)
    with Cluster(ClusterConfig(model=target_path, worker_args=args)) as cluster:
        outs = asyncio.run(one_by_one(cluster.router_address))
    assert [o.token_ids for o in outs] == expected
    if speculative:
        assert all(o.accept_lengths for o in outs)
    assert load_config(target_path).hidden_size == 2560
