"""A rank's shard of a Qwen3.5-35B-A3B-shaped model (its head counts: 16 query heads over 2 KV
heads of 256, GDN 16 key / 32 value heads of 128; hidden, experts and vocabulary cut down) at
TP 2 and 4 through every op with a Triton backend, run by Triton's interpreter on the CPU in
fp32, gives the reference kernels' logits on the same shard. With the GPU test beside it
(``test_shard_kernels_gpu.py``, bf16, FlashInfer included) this tells a Triton kernel that
mishandles a shard's head counts from a FlashInfer one."""

from __future__ import annotations

import os

import pytest
import torch

from common.cache.pools import CacheConfig, make_pools
from common.model.builtin import fill_deterministic
from common.model.family_registry import model_class_for, parse_model_config
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.kernels import Kernels
from common.ops.registry import GPU_OPS
from common.parallel.group import TensorParallelGroup
from tests.common.parallel.stand_in_group import NoOtherRank

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA machine runs the shard through its kernels in test_shard_kernels_gpu.py")

OURS = {op: "triton" for op, backends in GPU_OPS.items() if "triton" in backends}


def _shard(world_size: int, kernels: Kernels, expert_parallel: bool = False):
    from benchmarks.shapes import QWEN3_5_35B_A3B

    config = parse_model_config({**QWEN3_5_35B_A3B, "num_hidden_layers": 4, "hidden_size": 512,
                                 "num_experts": 16, "vocab_size": 2048, "dtype": "float32"})
    pg = NoOtherRank()
    model = model_class_for(config)(config, kernels=kernels,
                                    tp=TensorParallelGroup(0, world_size, pg, pg),
                                    expert_parallel=expert_parallel)
    fill_deterministic(model.named_parameters(), seed=5, device="cpu")
    return model.eval()


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_shard_runs_on_the_triton_kernels(world_size, expert_parallel):
    prompt = torch.randint(0, 2000, (20,), generator=torch.Generator().manual_seed(1))
    args = dict(mode=ForwardMode.EXTEND, token_ids=[prompt.tolist()], prefix_lens=[0],
                page_ids=[[1, 2]], page_size=16, state_slots=[1], return_all_logits=True)
    logits = {}
    for name, kernels in (("reference", Kernels.select()), ("triton", Kernels.select(OURS))):
        model = _shard(world_size, kernels, expert_parallel)
        kv_pool, state_pool = make_pools(model, CacheConfig(page_size=16, num_pages=8,
                                                            num_slots=3), "cpu")
        assert kv_pool.kv.shape[-2] == 2 // min(world_size, 2)  # KV heads split, then replicated
        with torch.no_grad():
            logits[name] = model(ForwardBatch.build(**args, device="cpu"), kv_pool=kv_pool,
                                 state_pool=state_pool).logits
    got, want = logits["triton"], logits["reference"]
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-4
