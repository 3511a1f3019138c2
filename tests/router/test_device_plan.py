"""How ``flashsplit up`` spreads ``--device`` over its workers."""

from __future__ import annotations

import pytest

from router.cli import build_parser, cluster_config_from_args
from router.cluster import ClusterConfig
from router.device_plan import worker_devices


def test_no_device_gives_none():
    assert worker_devices((), [1, 1]) == [None, None]


def test_one_entry_per_worker_cycles_prefill_first():
    assert worker_devices(("cuda",), [1, 1]) == ["cuda", "cuda"]
    assert worker_devices(("cuda:0", "cuda:1"), [1, 1, 1]) == ["cuda:0", "cuda:1", "cuda:0"]
    # a TP worker given one device starts its ranks there (the worker spreads them on)
    assert worker_devices(("cuda:2",), [2, 1]) == ["cuda:2", "cuda:2"]


def test_one_entry_per_rank_gives_each_tp_worker_gpus_of_its_own():
    devices = ("cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4")
    assert worker_devices(devices, [2, 1, 2]) == ["cuda:0,cuda:1", "cuda:2", "cuda:3,cuda:4"]


def test_more_devices_than_workers_that_are_not_one_per_rank_are_refused():
    with pytest.raises(ValueError, match="one per worker, or one per rank \\(4\\)"):
        worker_devices(("cuda:0", "cuda:1", "cuda:2"), [2, 2])
    with pytest.raises(ValueError, match="an empty device"):
        worker_devices(("cuda:0", " "), [1, 1])


def test_up_passes_each_worker_its_ranks_devices():
    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "2",
                                      "--device", "cuda:0,cuda:1,cuda:2,cuda:3"])
    assert cluster_config_from_args(args).worker_devices() == ["cuda:0,cuda:1",
                                                               "cuda:2,cuda:3"]


def test_a_cluster_config_refuses_devices_that_fit_no_rule():
    with pytest.raises(ValueError, match="3 devices for 2 workers"):
        ClusterConfig(prefill_tp=2, decode_tp=2, devices=("cuda:0", "cuda:1", "cuda:2"))
