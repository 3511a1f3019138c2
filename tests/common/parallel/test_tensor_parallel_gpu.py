"""Tensor parallelism on GPUs: an NCCL group of 2 (and 4) GPUs, one process per GPU, gives the
single-GPU model's logits to fp32 rounding and its greedy tokens, for every checkpoint kind and,
for the MoE kinds, with experts placed whole too (the CPU test's comparison,
test_tensor_parallel.py, with NCCL doing the collectives)."""

from __future__ import annotations

import pytest
import torch

from common.parallel.launch import LocalGroup
# checkpoints: the CPU test's fixture, shared
from tests.common.parallel.test_tensor_parallel import (MOE_KINDS, build,  # noqa: F401
                                                        checkpoints, outputs)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def single_gpu(checkpoints):
    return {kind: outputs(build(path, device="cuda:0")) for kind, path in checkpoints.items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_model_on_gpus_matches_one_gpu(checkpoints, single_gpu, world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    with LocalGroup(world_size, "cuda", timeout_s=300) as tp:
        for kind, path in checkpoints.items():
            for expert_parallel in (False, True) if kind in MOE_KINDS else (False,):
                logits, tokens, logprobs = outputs(build(path, tp, device="cuda:0",
                                                         expert_parallel=expert_parallel))
                want_logits, want_tokens, want_logprobs = single_gpu[kind]
                assert tokens == want_tokens, (kind, expert_parallel)
                for got, want in zip(logits, want_logits):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                           rtol=1e-5, atol=1e-5)


def _graph_engine(tp=None, draft: str | None = None):
    """The built-in trained model on cuda:0 with captured graphs (under TP: NCCL inside them)
    and overlap scheduling. Its 2 query heads split over 2 ranks at most; its head size of 128
    is one the GPU kernels' capturable plans take."""
    from common.engine.cuda_graph import CudaGraphConfig
    from common.engine.factory import EngineSettings, build_engine
    from common.engine.llm_engine import CacheConfig, EngineConfig

    world = 1 if tp is None else tp.world_size
    engine = EngineConfig(cache=CacheConfig(page_size=16, num_pages=256, num_slots=8),
                          device="cuda:0",
                          cuda_graph=CudaGraphConfig(max_batch_size=4, tensor_parallel=True))
    return build_engine(EngineSettings(model="pycoder", engine=engine, kernels="gpu",
                                       tensor_parallel_size=world, draft=draft), tp=tp).engine


def _graph_tokens(engine):
    from common.sampling import SamplingParams

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7] * 6]
    free = engine.load()
    reqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=32,
                                                   ignore_eos=True))
    assert engine.load()["free_pages"] == free["free_pages"]
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("world_size", [2])
def test_captured_graphs_on_gpus_give_one_gpus_tokens(world_size):
    """Decode and DFLASH verify replayed from graphs on every rank (NCCL captured in them),
    with overlap scheduling, give one GPU's greedy tokens."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    want = [_graph_tokens(_graph_engine()), _graph_tokens(_graph_engine(draft="pycoder"))]
    with LocalGroup(world_size, "cuda", timeout_s=300) as tp:
        engine = _graph_engine(tp)
        assert engine.runner.graphs is not None and engine.overlap is not None
        got = [_graph_tokens(engine), _graph_tokens(_graph_engine(tp, draft="pycoder"))]
    assert got == want
