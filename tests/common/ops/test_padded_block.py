"""The padded block of packed sequences the CPU backends batch over."""

from __future__ import annotations

import torch

from common.ops.padded_block import padded, real_tokens

CPU = torch.device("cpu")


def test_real_tokens_mark_each_sequences_own_positions():
    assert real_tokens([3, 1, 0], CPU).tolist() == [[True, True, True],
                                                   [True, False, False],
                                                   [False, False, False]]


def test_padded_rows_follow_the_packing_and_padding_names_row_0():
    index, real = padded([2, 3, 1], CPU)
    assert index.tolist() == [0, 1, 0, 2, 3, 4, 5, 0, 0]
    assert real.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    rows = torch.arange(6) * 10
    assert rows[index][real.flatten()].tolist() == rows.tolist()  # every packed row, once


def test_given_starts_place_sequences_anywhere_in_the_packing():
    # equal lengths out of order still need the gather; in order from any row they do not
    index, real = padded([2, 2], CPU, starts=[4, 0])
    assert index.tolist() == [4, 5, 0, 1] and real.all()
    assert padded([2, 2], CPU, starts=[3, 5]) == (None, None)


def test_equal_sequences_back_to_back_are_the_block_already():
    assert padded([4, 4, 4], CPU) == (None, None)
