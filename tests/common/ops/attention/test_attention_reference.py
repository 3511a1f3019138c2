import pytest
import torch
import torch.nn.functional as F

from common.ops.attention.reference import paged_attention

H, KVH, D, PAGE = 6, 2, 16, 4


def _setup(prefix, extend, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    totals = [p + e for p, e in zip(prefix, extend)]
    max_pages = max(-(-t // PAGE) for t in totals) + 1
    num_pages = len(totals) * max_pages + 3
    # Pages handed out in shuffled order; page 0 stays unused as the scratch page.
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1)[: len(totals) * max_pages]
    page_table = perm.reshape(len(totals), max_pages).to(torch.int32)
    k_cache = torch.randn(num_pages, PAGE, KVH, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, PAGE, KVH, D, generator=gen).to(dtype)
    dense_k, dense_v = [], []
    for r, total in enumerate(totals):
        k = torch.randn(total, KVH, D, generator=gen).to(dtype)
        v = torch.randn(total, KVH, D, generator=gen).to(dtype)
        for p in range(total):
            k_cache[page_table[r, p // PAGE], p % PAGE] = k[p]
            v_cache[page_table[r, p // PAGE], p % PAGE] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(extend), H, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, page_table, dense_k, dense_v


def _dense_reference(q, dense_k, dense_v, prefix, extend, scale):
    outs, start = [], 0
    for k, v, p, e in zip(dense_k, dense_v, prefix, extend):
        qr = q[start : start + e].float().transpose(0, 1)  # [H, e, D]
        kr = k.float().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        vr = v.float().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        mask = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        outs.append(F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale).transpose(0, 1))
        start += e
    return torch.cat(outs)


@pytest.mark.parametrize(
    "prefix,extend",
    [([0, 0], [7, 13]), ([5, 0, 17], [1, 9, 6]), ([3, 11, 2], [1, 1, 1])],  # prefill, chunked, decode
)
def test_matches_dense_causal_sdpa(prefix, extend):
    q, k_cache, v_cache, page_table, dk, dv = _setup(prefix, extend)
    scale = D**-0.5
    o = paged_attention(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
        prefix_lens=prefix, extend_lens=torch.tensor(extend), scale=scale,
    )
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o, _dense_reference(q, dk, dv, prefix, extend, scale), rtol=1e-5, atol=1e-6)


def test_bf16_returns_bf16():
    prefix, extend = [2, 6], [5, 3]
    q, k_cache, v_cache, page_table, dk, dv = _setup(prefix, extend, dtype=torch.bfloat16, seed=1)
    o = paged_attention(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
        prefix_lens=torch.tensor(prefix), extend_lens=extend, scale=0.3,
    )
    assert o.dtype == torch.bfloat16
    expected = _dense_reference(q, dk, dv, prefix, extend, 0.3)
    torch.testing.assert_close(o.float(), expected, rtol=2e-2, atol=2e-2)


def test_caller_mistakes_raise_value_error():
    q, k_cache, v_cache, page_table, _, _ = _setup([1], [3], seed=2)
    common = dict(k_cache=k_cache, v_cache=v_cache, page_table=page_table, scale=0.25)
    with pytest.raises(ValueError, match="extend_lens"):
        paged_attention(q=q, prefix_lens=[1], extend_lens=[2], **common)
    with pytest.raises(ValueError, match="prefix_lens"):
        paged_attention(q=q, prefix_lens=[1, 0], extend_lens=[3], **common)
    with pytest.raises(ValueError, match="max_pages"):
        paged_attention(q=q, prefix_lens=[100], extend_lens=[3], **common)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q=q[:, :5], prefix_lens=[1], extend_lens=[3], **common)
