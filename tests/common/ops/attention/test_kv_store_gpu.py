"""Triton store_paged_kv against the reference (and ``KVPool.write``), on the GPU.

A store is a copy with at most one cast (round to nearest even, as torch's ``.to``), so the pool
must come out bit-identical: the written slots hold the new K/V, every other slot is untouched.
"""

from __future__ import annotations

import pytest
import torch

from common.cache.kv_pool import KVPool
from common.ops.attention import kv_store_reference as ref

pytestmark = pytest.mark.gpu

LAYERS = (3, 7)  # model layer ids of the pool's two layers


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.attention import kv_store_triton

    return kv_store_triton


def _pool(gen, *, tokens, page_size, kvh, d, dtype):
    """A pool with random (non-zero) contents, large enough for ``tokens`` slots plus spare pages."""
    pool = KVPool(layer_ids=LAYERS, num_pages=-(-tokens // page_size) + 3, page_size=page_size,
                  num_kv_heads=kvh, head_dim=d, dtype=dtype, device="cuda")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen, device="cuda"))
    return pool


def _slots(gen, pool, tokens):
    """``tokens`` distinct flat slots in shuffled order, slot 0 among them."""
    n = pool.num_pages * pool.page_size
    loc = torch.randperm(n - 1, generator=gen, device="cuda")[:tokens - 1] + 1
    loc = torch.cat([loc, torch.zeros(1, dtype=loc.dtype, device="cuda")])
    return loc[torch.randperm(tokens, generator=gen, device="cuda")].to(torch.int64)


def _kv_views(gen, tokens, kvh, d, dtype):
    """k and v as strided views of one [T, KVH, 3D] projection, as a fused qkv GEMM leaves them."""
    qkv = torch.randn(tokens, kvh, 3 * d, generator=gen, device="cuda").to(dtype)
    return qkv[..., d:2 * d], qkv[..., 2 * d:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 301])
@pytest.mark.parametrize("kvh,d,page_size", [(4, 256, 16), (4, 128, 4)])
def test_store_paged_kv_matches_reference_and_pool_write(record_metric, dtype, tokens, kvh, d, page_size):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens * d + page_size)
    pool = _pool(gen, tokens=tokens, page_size=page_size, kvh=kvh, d=d, dtype=dtype)
    want_ref, want_write = pool.kv.clone(), pool.kv.clone()
    loc = _slots(gen, pool, tokens)
    k, v = _kv_views(gen, tokens, kvh, d, dtype)
    tr.store_paged_kv(kv=pool.layer_kv(LAYERS[1]), loc=loc, k=k, v=v)
    ref.store_paged_kv(kv=want_ref[1], loc=loc, k=k, v=v)
    got = pool.kv
    pool.kv = want_write  # the same pool with its contents from before the store, for write()
    pool.write(LAYERS[1], loc, k, v)
    record_metric("max_abs", (got.float() - want_ref.float()).abs().max().item())
    assert torch.equal(got, want_ref)
    assert torch.equal(got, want_write)
    page, offset = loc // page_size, loc % page_size
    assert torch.equal(got[1, page, 0, offset], k) and torch.equal(got[1, page, 1, offset], v)


@pytest.mark.parametrize("kv_dtype,in_dtype", [(torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16),
                                               (torch.float16, torch.bfloat16)])
def test_store_paged_kv_casts_like_torch(record_metric, kv_dtype, in_dtype):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(5)
    pool = _pool(gen, tokens=37, page_size=16, kvh=4, d=128, dtype=kv_dtype)
    want = pool.kv.clone()
    loc = _slots(gen, pool, 37)
    k, v = _kv_views(gen, 37, 4, 128, in_dtype)
    tr.store_paged_kv(kv=pool.layer_kv(LAYERS[0]), loc=loc, k=k, v=v)
    ref.store_paged_kv(kv=want[0], loc=loc, k=k, v=v)
    record_metric("max_abs", (pool.kv.float() - want.float()).abs().max().item())
    assert torch.equal(pool.kv, want)


def test_store_paged_kv_fallbacks_and_errors():
    tr = _triton()
    kv = torch.randn(3, 2, 4, 2, 8)
    loc = torch.tensor([5, 0, 9])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    got, want = kv.clone(), kv.clone()
    tr.store_paged_kv(kv=got, loc=loc, k=k, v=v)
    ref.store_paged_kv(kv=want, loc=loc, k=k, v=v)
    assert torch.equal(got, want)
    got, want = kv.double().cuda(), kv.double().cuda()
    tr.store_paged_kv(kv=got, loc=loc.cuda(), k=k.cuda(), v=v.cuda())
    ref.store_paged_kv(kv=want, loc=loc.cuda(), k=k.cuda(), v=v.cuda())
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="k and v must"):
        tr.store_paged_kv(kv=kv.cuda(), loc=loc.cuda(), k=k.cuda(), v=v[:, :1].cuda())
    with pytest.raises(ValueError, match="loc must"):
        tr.store_paged_kv(kv=kv.cuda(), loc=loc[:2].cuda(), k=k.cuda(), v=v.cuda())


def test_store_paged_kv_replays_in_a_cuda_graph():
    """No host synchronisation: the store captures, and a replay writes the new K/V to the new
    slots after loc, k and v are changed in place."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(14)
    pool = _pool(gen, tokens=64, page_size=16, kvh=4, d=256, dtype=torch.bfloat16)
    loc = _slots(gen, pool, 8)
    k, v = _kv_views(gen, 8, 4, 256, torch.bfloat16)
    layer = pool.layer_kv(LAYERS[0])
    tr.store_paged_kv(kv=layer, loc=loc, k=k, v=v)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tr.store_paged_kv(kv=layer, loc=loc, k=k, v=v)
    loc.copy_(_slots(gen, pool, 8))
    new_k, new_v = _kv_views(gen, 8, 4, 256, torch.bfloat16)
    k.copy_(new_k)
    v.copy_(new_v)
    want = pool.kv.clone()
    ref.store_paged_kv(kv=want[0], loc=loc, k=k, v=v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.kv, want)
