"""FlashInfer paged attention against the reference; the page-index builder on the CPU.

Pools are laid out as ``KVPool`` lays them out (K and V are strided views of one
``[pages, 2, page_size, kv_heads, head_dim]`` tensor), pages are handed out in random order,
page-table rows are padded with the scratch page 0, and every cache entry (scratch and unused
ones too) holds random values, so reading a wrong page shows. bf16 tolerances: relative RMSE
<= 1e-2 and cosine >= 0.9999 against the fp32 reference on the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.attention import reference as ref
from common.ops.attention.flashinfer import page_indices
from tests.common.compare import cosine, rel_rmse

PAGE = 16


def test_page_indices_cpu():
    table = torch.tensor([[5, 9, 0, 0], [7, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.int32)
    indptr, indices, last = page_indices(table, [17, 16, 49], page_size=16)
    assert indptr.tolist() == [0, 2, 3, 7]
    assert indices.tolist() == [5, 9, 7, 1, 2, 3, 4]
    assert last.tolist() == [1, 16, 1]
    assert indices.dtype == indptr.dtype == last.dtype == torch.int32
    with pytest.raises(ValueError, match="max_pages"):
        page_indices(table, [65, 1, 1], page_size=16)


def make_case(prefix, extend, heads, kv_heads, head_dim=256, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = len(prefix)
    need = [-(-(p + e) // PAGE) for p, e in zip(prefix, extend)]
    num_pages = sum(need) + 5
    kv = torch.randn(num_pages, 2, PAGE, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    rows, at = [], 0
    for c in need:
        rows.append(order[at : at + c].tolist())
        at += c
    width = max(need)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(extend), heads, head_dim, generator=gen, device="cuda").to(dtype)
    return dict(q=q, k_cache=kv[:, 0], v_cache=kv[:, 1], page_table=table, prefix_lens=list(prefix),
                extend_lens=list(extend), scale=head_dim ** -0.5), n


def _fi():
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from common.ops.attention import flashinfer as fi

    return fi


CASES = {
    # mixed chunked prefill: fresh prompts, continuations, a one-token request, an idle one
    "prefill": ([0, 17, 100, 1000, 5, 0], [37, 1, 130, 64, 0, 300]),
    "prefill_fresh": ([0], [1000]),
    "decode": ([4000, 1, 15, 16, 17, 333, 2048, 0], [1] * 8),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
# Qwen3.5-4B, Qwen3.5-35B-A3B, and a rank of 35B-A3B at TP 2 and 8 (one KV head each)
@pytest.mark.parametrize("heads,kv_heads", [(16, 4), (16, 2), (8, 1), (2, 1)])
def test_flashinfer_matches_reference(record_metric, case, heads, kv_heads):
    fi = _fi()
    prefix, extend = CASES[case]
    inp, _ = make_case(prefix, extend, heads, kv_heads, seed=len(prefix) + kv_heads)
    k_before = inp["k_cache"].clone()
    got = fi.paged_attention(**inp)
    want = ref.paged_attention(**inp)
    assert got.shape == want.shape and got.dtype == want.dtype
    rm, cs = rel_rmse(got, want), cosine(got, want)
    record_metric("o.rel_rmse", rm)
    record_metric("o.cosine", cs)
    record_metric("o.max_abs", (got.float() - want.float()).abs().max().item())
    assert rm <= 1e-2 and cs >= 0.9999
    assert torch.equal(inp["k_cache"], k_before)


@pytest.mark.gpu
def test_flashinfer_repeated_calls_replan():
    """One wrapper serves calls of different shapes in turn (plan per call)."""
    fi = _fi()
    a, _ = make_case(*CASES["prefill"], 16, 4, seed=1)
    b, _ = make_case(*CASES["decode"], 16, 4, seed=2)
    first = fi.paged_attention(**a)
    fi.paged_attention(**b)
    again = fi.paged_attention(**a)
    assert torch.equal(first, again)


@pytest.mark.gpu
def test_unsupported_inputs_use_reference():
    """fp32 and head dim 32 (the tiny model) are not FlashInfer's: the reference answers."""
    fi = _fi()
    for dtype, hd in ((torch.float32, 256), (torch.bfloat16, 32)):
        inp, _ = make_case([3, 0], [5, 9], 4, 2, head_dim=hd, dtype=dtype, seed=3)
        assert not fi.supports(inp["q"], inp["k_cache"])
        assert torch.equal(fi.paged_attention(**inp), ref.paged_attention(**inp))
