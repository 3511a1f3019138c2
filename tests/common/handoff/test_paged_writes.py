"""A layer of a paged payload field lands at the request's pages, whole pages and pieces at odd
byte offsets alike, in a whole pool and in a pool narrowed to a band of heads."""

from __future__ import annotations

import pytest
import torch

from common.handoff.paged_writes import write_paged

L, POOL_PAGES, PAGE, HEADS, D = 2, 9, 4, 4, 8


@pytest.mark.parametrize("heads", [slice(0, HEADS), slice(1, 3)])
@pytest.mark.parametrize("cuts", [(), (7,), (3, 130, 131, 517)])
@pytest.mark.parametrize("page_ids", [[5, 1, 7], [2, 3, 4, 8, 6, 7]])  # runs of consecutive ids
def test_bytes_land_at_the_request_pages(heads, cuts, page_ids):
    gen = torch.Generator().manual_seed(len(cuts) + heads.start)
    pool = torch.zeros(L, POOL_PAGES, 2, PAGE, HEADS, D, dtype=torch.bfloat16)
    width = heads.stop - heads.start
    field = torch.randn(2, len(page_ids), PAGE, width, D, generator=gen).to(torch.bfloat16)
    raw = field.reshape(-1).view(torch.uint8)
    bounds = [0, *cuts, raw.numel()]
    for a, b in reversed(list(zip(bounds, bounds[1:]))):  # any split, in any order
        write_paged(pool[:, :, :, :, heads], 1, page_ids, len(page_ids), a,
                    bytes(raw[a:b].numpy()))
    for i, page in enumerate(page_ids):
        assert torch.equal(pool[1, page, :, :, heads], field[:, i])
    untouched = torch.ones(POOL_PAGES, dtype=torch.bool)
    untouched[page_ids] = False
    assert not pool[0].any() and not pool[1, untouched].any()
    if heads != slice(0, HEADS):
        assert not pool[1, :, :, :, :heads.start].any() and not pool[1, :, :, :, heads.stop:].any()
