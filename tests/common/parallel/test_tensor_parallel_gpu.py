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
