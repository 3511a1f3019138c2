"""A graph step's packed inputs, filled from arrays, equal those written token by token."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.static_inputs import StaticInputs


def token_by_token(max_rows, q_len, token_ids, starts, page_ids, slots, page_size):
    """The packed buffer as the definition says: per token its id, position and flat KV slot,
    then one state slot per row; padding all zeros."""
    t = max_rows * q_len
    packed = [0] * (3 * t + max_rows)
    i = 0
    for r, (start, pages) in enumerate(zip(starts, page_ids)):
        for j in range(q_len):
            p = start + j
            packed[i] = token_ids[r][j] if token_ids is not None else 0
            packed[t + i] = p
            packed[2 * t + i] = pages[p // page_size] * page_size + p % page_size
            i += 1
    packed[3 * t:3 * t + len(slots)] = slots
    return packed


@pytest.mark.parametrize("q_len,page_size", [(1, 1), (1, 16), (3, 1), (3, 4), (16, 4), (16, 16),
                                             (5, 16)])
def test_fill_equals_token_by_token(q_len, page_size):
    rng = random.Random(q_len * 100 + page_size)
    max_rows = 7
    inputs = StaticInputs(max_rows, q_len, torch.device("cpu"))
    for n in (0, 1, 4, max_rows):
        starts = [rng.randint(0, 90) for _ in range(n)]
        pages = [rng.sample(range(1, 500), (s + q_len - 1) // page_size + 1 + rng.randint(0, 2))
                 for s in starts]
        ids = [[rng.randint(0, 999) for _ in range(q_len)] for _ in range(n)]
        slots = [rng.randint(1, 30) for _ in range(n)]
        for token_ids in (ids, None):
            inputs.fill(token_ids, starts, pages, slots, page_size)
            want = token_by_token(max_rows, q_len, token_ids, starts, pages, slots, page_size)
            assert inputs.packed.tolist() == want


def test_a_row_without_the_page_for_its_last_token_is_an_error():
    inputs = StaticInputs(2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="row 1: 1 pages hold no page for position 6"):
        inputs.fill([[1, 2, 3, 4]] * 2, [0, 3], [[5], [6]], [1, 2], 4)
