"""The CPU paged attention against its reference on fresh random caches of odd sizes: prefill,
chunked prefill, decode and verify-like batches, GQA, requests without new tokens, a batch
padded past its work (run request by request), and stale pages holding NaN. fp64 agrees to
1e-12, fp32 to fp32 rounding, bf16 within a bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from common.ops.attention import paged_cpu, reference

PAGE, D = 3, 7


def inputs(prefix, extend, *, h, kvh, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    totals = [p + e for p, e in zip(prefix, extend)]
    max_pages = max(-(-t // PAGE) for t in totals) + 2
    num_pages = len(totals) * max_pages + 2
    # shuffled pages; the columns a request does not use name pages past the cache (never read)
    table = (torch.randperm(num_pages - 1, generator=gen) + 1)[:len(totals) * max_pages]
    table = table.reshape(len(totals), max_pages)
    for r, total in enumerate(totals):
        table[r, -(-total // PAGE):] = num_pages + 5
    cache = torch.randn(2, num_pages, PAGE, kvh, D, generator=gen, dtype=torch.float64).to(dtype)
    q = torch.randn(sum(extend), h, D, generator=gen, dtype=torch.float64).to(dtype)
    return dict(q=q, k_cache=cache[0], v_cache=cache[1], page_table=table.to(torch.int32),
                prefix_lens=prefix, extend_lens=torch.tensor(extend), scale=D ** -0.5)


CASES = [([0, 0], [7, 13]),            # prefill
         ([5, 0, 17], [1, 9, 6]),      # chunked prefill beside a decode row
         ([3, 11, 2, 8], [1, 1, 1, 1]),  # decode
         ([4, 9, 6], [5, 5, 5]),       # verify: blocks of one length
         ([2, 6, 1], [3, 0, 4]),       # a request without new tokens
         ([40, 0], [1, 30])]           # padding would dominate: request by request


@pytest.mark.parametrize("prefix,extend", CASES)
@pytest.mark.parametrize("h,kvh", [(6, 2), (3, 3), (5, 1)])
def test_fp64_matches_reference(prefix, extend, h, kvh):
    args = inputs(prefix, extend, h=h, kvh=kvh, dtype=torch.float64, seed=sum(extend) + h)
    want = reference.paged_attention(**args)
    got = paged_cpu.paged_attention(**args)
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_precision_matches_reference(dtype, tol):
    args = inputs([5, 0, 17, 3], [1, 9, 6, 1], h=6, kvh=2, dtype=dtype, seed=4)
    got = paged_cpu.paged_attention(**args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, reference.paged_attention(**args), rtol=tol, atol=tol)


def test_stale_positions_are_never_weighted():
    """NaN everywhere a request's positions are not (the rest of its last page, the scratch
    page) leaves the output as the reference's."""
    args = inputs([4, 9], [1, 1], h=4, kvh=2, dtype=torch.float64, seed=8)
    want = reference.paged_attention(**args)
    table = args["page_table"]
    for cache in (args["k_cache"], args["v_cache"]):
        cache[0] = float("nan")
        for r, total in enumerate((5, 10)):
            cache[table[r, (total - 1) // PAGE], (total - 1) % PAGE + 1:] = float("nan")
    got = paged_cpu.paged_attention(**args)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_caller_mistakes_raise_value_error():
    args = inputs([2, 3], [1, 1], h=4, kvh=2, seed=1)
    with pytest.raises(ValueError, match="outside"):
        paged_cpu.paged_attention(**dict(args, page_table=args["page_table"] + 100))
    with pytest.raises(ValueError, match="extend_lens"):
        paged_cpu.paged_attention(**dict(args, extend_lens=[1, 2]))
    with pytest.raises(ValueError, match="multiple"):
        paged_cpu.paged_attention(**dict(args, q=args["q"][:, :3]))
