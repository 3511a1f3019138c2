"""The range arithmetic of per-rank handoff streams: every head of every field reaches every
decode rank that holds it exactly once, from one prefill rank that holds it, and a band sits
inside one range of each side's pools."""

from __future__ import annotations

import pytest

from common.handoff.bands import Band
from common.model.registry import load_config
from common.parallel.rank_streams import (bands_from, bands_to, held_ranges, local_start,
                                          owned_pieces, transfers)
from common.parallel.shard_plan import ShardingError

SIZES = [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 1), (1, 4)]


@pytest.fixture(scope="module")
def config():
    return load_config("tiny")  # 2 KV heads, 2 GDN key heads, 4 value heads


def indices(ranges):
    return [i for start, stop in ranges for i in range(start, stop)]


@pytest.mark.parametrize("src_tp,dst_tp", SIZES)
def test_each_decode_rank_gets_exactly_what_it_holds(config, src_tp, dst_tp):
    for dst in range(dst_tp):
        for name, ranges in held_ranges(config, dst, dst_tp).items():
            got = sorted(i for b in bands_to(config, src_tp, dst_tp, dst) if b.field == name
                         for i in range(b.start, b.stop))
            assert got == sorted(indices(ranges)), (name, dst)


@pytest.mark.parametrize("src_tp,dst_tp", SIZES)
def test_each_band_comes_from_a_prefill_rank_that_holds_it(config, src_tp, dst_tp):
    for t in transfers(config, src_tp, dst_tp):
        src_held = held_ranges(config, t.src, src_tp)[t.band.field]
        dst_held = held_ranges(config, t.dst, dst_tp)[t.band.field]
        local_start(src_held, t.band)  # inside one range of each side (else ValueError)
        local_start(dst_held, t.band)


def test_a_replicated_head_leaves_prefill_once(config):
    # TP 4: ranks 0 and 1 both hold KV head 0; only rank 0 sends it
    pieces = owned_pieces(config, 4)["kv"]
    assert pieces == [(0, 1, 0), (1, 2, 2)]
    assert not [b for b in bands_from(config, 4, 1, 1) if b.field == "kv"]
    # and to decode TP 4 it goes to both ranks that hold it
    assert bands_from(config, 2, 4, 0)[Band("kv", 0, 1)] == (0, 1)


def test_a_size_that_does_not_divide_the_heads_is_refused(config):
    with pytest.raises(ShardingError):
        transfers(config, 3, 1)


def test_local_start_counts_the_ranges_before():
    ranges = ((0, 32), (64, 96), (128, 160))
    assert local_start(ranges, Band("conv_state", 64, 80)) == 32
    assert local_start(ranges, Band("conv_state", 130, 160)) == 66
    with pytest.raises(ValueError):
        local_start(ranges, Band("conv_state", 20, 70))  # across a gap
