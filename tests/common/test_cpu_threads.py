"""common/cpu_threads.py: a cgroup's CPU quota read in both layouts, a worker's thread count."""

from __future__ import annotations

import pytest

from common.cpu_threads import available_cpus, cgroup_cpu_limit, worker_cpu_threads


def _v1(tmp_path, quota: str, period: str):
    q, p = tmp_path / "cpu.cfs_quota_us", tmp_path / "cpu.cfs_period_us"
    q.write_text(quota + "\n")
    p.write_text(period + "\n")
    return q, p


@pytest.mark.parametrize("text, cpus", [("400000 100000", 4), ("150000 100000", 2),
                                         ("50000 100000", 1), ("max 100000", None)])
def test_a_cgroup_v2_quota_in_cpus_rounded_up(tmp_path, text, cpus):
    v2 = tmp_path / "cpu.max"
    v2.write_text(text + "\n")
    assert cgroup_cpu_limit(v2, (tmp_path / "none", tmp_path / "none")) == cpus


def test_a_cgroup_v1_quota_when_there_is_no_v2_file(tmp_path):
    missing = tmp_path / "cpu.max"
    assert cgroup_cpu_limit(missing, _v1(tmp_path, "300000", "100000")) == 3
    assert cgroup_cpu_limit(missing, _v1(tmp_path, "-1", "100000")) is None


def test_no_cgroup_files_and_garbage_mean_no_limit(tmp_path):
    missing = tmp_path / "cpu.max"
    assert cgroup_cpu_limit(missing, (tmp_path / "a", tmp_path / "b")) is None
    missing.write_text("what 100000\n")
    assert cgroup_cpu_limit(missing, (tmp_path / "a", tmp_path / "b")) is None


def test_a_worker_takes_the_count_it_is_given_or_every_cpu_it_may_use():
    import os

    assert worker_cpu_threads(3) == 3
    assert worker_cpu_threads(0) == available_cpus()
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="--cpu-threads must be >= 0"):
        worker_cpu_threads(-1)
