"""On one GPU: a rank's shard of a Qwen3.5-35B-A3B-shaped model (4 layers, random bf16 weights)
at TP 2, 4 and 8 runs through the GPU kernel set (FlashInfer, Triton, fla) with the head counts
a shard has (one replicated KV head, 2–8 GDN value heads over 1–8 key heads, 1/N of each expert)
and gives the reference kernels' logits on the same shard. No other rank is there: a stand-in
process group makes every collective a no-op, which is the same for both kernel sets."""

from __future__ import annotations

import pytest
import torch

from common.cache.pools import CacheConfig, make_pools
from common.model.builtin import fill_deterministic
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.parallel.group import TensorParallelGroup
from tests.common.parallel.stand_in_group import NoOtherRank

pytestmark = pytest.mark.gpu


def _shard(world_size: int, kernels):
    from benchmarks.shapes import QWEN3_5_35B_A3B
    from common.model.family_registry import model_class_for, parse_model_config

    config = parse_model_config({**QWEN3_5_35B_A3B, "num_hidden_layers": 4})
    pg = NoOtherRank()
    with torch.device("cuda"):
        model = model_class_for(config)(config, kernels=kernels,
                                        tp=TensorParallelGroup(0, world_size, pg, pg))
    fill_deterministic(model.named_parameters(), seed=5, device="cuda")
    return model.eval()


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_a_shard_runs_on_the_gpu_kernels(world_size):
    from common.model.kernels import Kernels, select_kernels

    prompt = torch.randint(0, 240000, (37,), generator=torch.Generator().manual_seed(1))
    args = dict(mode=ForwardMode.EXTEND, token_ids=[prompt.tolist()], prefix_lens=[0],
                page_ids=[[1, 2, 3]], page_size=16, state_slots=[1], return_all_logits=True)
    logits = {}
    for name, kernels in (("reference", Kernels.select()), ("gpu", select_kernels("gpu"))):
        model = _shard(world_size, kernels)
        kv_pool, state_pool = make_pools(model, CacheConfig(page_size=16, num_pages=8,
                                                            num_slots=3), "cuda")
        assert kv_pool.kv.shape[-2] == 1  # one of the 2 KV heads on every rank
        batch = ForwardBatch.build(**args, device="cuda")
        logits[name] = model(batch, kv_pool=kv_pool, state_pool=state_pool).logits
    got, want = logits["gpu"], logits["reference"]
    assert torch.isfinite(got).all()
    relative = (got - want).norm() / want.norm()
    assert relative < 2e-2, relative  # bf16 kernels against bf16 reference
