"""The CPU DFLASH draft block attention against its reference on fresh random inputs of odd
sizes: causal or not, with and without a sliding window, contexts of different lengths (one
empty), and stale cache positions holding NaN. fp64 agrees to 1e-12, bf16 within a bf16
rounding."""

from __future__ import annotations

import pytest
import torch

from common.ops.attention import draft_cpu, draft_reference

PAGE, D = 4, 6


def inputs(ctx, block, *, h, kvh, dtype=torch.float64, seed=0, causal=False, window=None):
    gen = torch.Generator().manual_seed(seed)
    n = len(ctx)
    max_pages = max(-(-c // PAGE) for c in ctx) + 1
    num_pages = n * max_pages + 2
    table = (torch.randperm(num_pages - 1, generator=gen) + 1)[:n * max_pages].view(n, max_pages)
    cache = torch.randn(2, num_pages, PAGE, kvh, D, generator=gen, dtype=torch.float64).to(dtype)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return dict(q=rand(n, block, h, D), block_k=rand(n, block, kvh, D),
                block_v=rand(n, block, kvh, D), k_cache=cache[0], v_cache=cache[1],
                page_table=table, context_lens=ctx, start_positions=[c + 2 * (c % 2) for c in ctx],
                scale=D ** -0.5, causal=causal, sliding_window=window)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 6)])
@pytest.mark.parametrize("h,kvh", [(6, 2), (3, 3)])
def test_fp64_matches_reference(causal, window, h, kvh):
    args = inputs([9, 0, 14], 5, h=h, kvh=kvh, causal=causal, window=window, seed=h)
    want = draft_reference.draft_block_attention(**args)
    got = draft_cpu.draft_block_attention(**args)
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bf16_and_stale_positions():
    args = inputs([7, 13], 4, h=4, kvh=1, dtype=torch.bfloat16, seed=3)
    want = draft_reference.draft_block_attention(**args)
    for cache in (args["k_cache"], args["v_cache"]):
        cache[0] = float("nan")  # the scratch page
        cache[args["page_table"][0, 1], 3:] = float("nan")  # past the 7 positions of row 0
    got = draft_cpu.draft_block_attention(**args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_only_block_keys_without_context():
    args = inputs([0, 0], 3, h=2, kvh=1, seed=5)
    torch.testing.assert_close(draft_cpu.draft_block_attention(**args),
                               draft_reference.draft_block_attention(**args),
                               rtol=1e-12, atol=1e-12)


def test_caller_mistakes_raise_value_error():
    args = inputs([5, 3], 2, h=2, kvh=1, seed=1)
    with pytest.raises(ValueError, match="start_positions"):
        draft_cpu.draft_block_attention(**dict(args, start_positions=[1, 1]))
    with pytest.raises(ValueError, match="outside"):
        draft_cpu.draft_block_attention(**dict(args, page_table=args["page_table"] + 50))
    with pytest.raises(ValueError, match="sliding_window"):
        draft_cpu.draft_block_attention(**dict(args, sliding_window=0))
