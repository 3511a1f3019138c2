"""common/parallel/placement.py: a device per rank, and the ranks' share of the threads."""

from __future__ import annotations

import pytest

from common.cpu_threads import available_cpus
from common.parallel.placement import cpu_threads_per_rank, rank_devices


def test_devices_per_rank():
    assert rank_devices("cpu", 3) == ["cpu"] * 3
    assert rank_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert rank_devices("cuda:2", 2) == ["cuda:2", "cuda:3"]
    assert rank_devices("cuda:1,cuda:0", 2) == ["cuda:1", "cuda:0"]
    with pytest.raises(ValueError, match="3 devices given for 2 ranks"):
        rank_devices("cuda:0,cuda:1,cuda:2", 2)
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        rank_devices("mps", 2)


def test_the_ranks_share_the_threads_given_or_every_cpu():
    assert cpu_threads_per_rank(2, 6) == 3
    assert cpu_threads_per_rank(4, 2) == 1  # at least one each
    assert cpu_threads_per_rank(1) == available_cpus()
