import pytest
import torch

from common.cache.kv_pool import KVPool
from common.ops.attention.kv_store_reference import store_paged_kv

LAYERS = (3, 7)


def _pool(dtype=torch.float32, page_size=4):
    pool = KVPool(layer_ids=LAYERS, num_pages=6, page_size=page_size, num_kv_heads=2, head_dim=8,
                  dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def test_layer_kv_is_a_view_of_the_pool_layer():
    pool = _pool()
    kv = pool.layer_kv(LAYERS[1])
    assert kv.shape == (6, 2, 4, 2, 8) and kv.data_ptr() == pool.kv[1].data_ptr()
    k_cache, v_cache = pool.layer_cache(LAYERS[1])
    assert torch.equal(kv[:, 0], k_cache) and torch.equal(kv[:, 1], v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_paged_kv_equals_pool_write_and_touches_nothing_else(dtype):
    gen = torch.Generator().manual_seed(1)
    pool, other = _pool(dtype), _pool(dtype)
    before = pool.kv.clone()
    loc = torch.tensor([13, 0, 22, 5, 8])  # shuffled, slot 0 included
    qkv = torch.randn(5, 2, 24, generator=gen)  # k and v as strided views of a projection, in fp32
    k, v = qkv[..., 8:16], qkv[..., 16:]
    store_paged_kv(kv=pool.layer_kv(LAYERS[0]), loc=loc, k=k, v=v)
    other.write(LAYERS[0], loc, k, v)
    assert torch.equal(pool.kv, other.kv)
    page, offset = loc // 4, loc % 4
    assert torch.equal(pool.kv[0, page, 0, offset], k.to(dtype))
    assert torch.equal(pool.kv[0, page, 1, offset], v.to(dtype))
    written = torch.zeros(6, 4, dtype=torch.bool)
    written[page, offset] = True
    assert torch.equal(pool.kv[0][~written.unsqueeze(1).expand(6, 2, 4)],
                       before[0][~written.unsqueeze(1).expand(6, 2, 4)])
    assert torch.equal(pool.kv[1], before[1])


def test_store_paged_kv_rejects_bad_shapes():
    kv = _pool().layer_kv(LAYERS[0])
    k = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="kv must be"):
        store_paged_kv(kv=kv[:, 0], loc=torch.tensor([1, 2, 3]), k=k, v=k)
    with pytest.raises(ValueError, match="k and v must"):
        store_paged_kv(kv=kv, loc=torch.tensor([1, 2, 3]), k=k, v=k[..., :4])
    with pytest.raises(ValueError, match="loc must"):
        store_paged_kv(kv=kv, loc=torch.tensor([1, 2]), k=k, v=k)
    with pytest.raises(ValueError, match="loc must"):
        store_paged_kv(kv=kv, loc=torch.tensor([1.0, 2.0, 3.0]), k=k, v=k)
