"""router/supervisor.py over a Cluster of fake worker processes (tests/router/fake_worker.py)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time

import pytest

from router.cluster import Cluster, ClusterConfig
from router.supervisor import Supervisor, SupervisorConfig, restart_delay
from tests.router.test_cluster import FAKES

FAST = SupervisorConfig(probe_interval_s=0.1, probe_timeout_s=0.3, unresponsive_after_s=1.0,
                        backoff_initial_s=0.2, backoff_max_s=0.8)


def test_restart_delay_doubles_up_to_its_cap():
    assert [restart_delay(FAST, n) for n in range(1, 6)] == [0.2, 0.4, 0.8, 0.8, 0.8]
    with pytest.raises(ValueError):
        SupervisorConfig(backoff_initial_s=2.0, backoff_max_s=1.0)


def supervise_until(supervisor: Supervisor, done, timeout_s: float = 20.0) -> None:
    """Tick until ``done()``; fails after ``timeout_s``."""
    async def loop():
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, supervisor.out.getvalue()
            await supervisor.tick()
            await asyncio.sleep(FAST.probe_interval_s)

    asyncio.run(loop())


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"], ids=["exited", "hung"])
def test_a_failed_worker_is_restarted_on_its_port(fault):
    config = ClusterConfig(num_prefill=1, num_decode=1, start_timeout_s=60, stop_grace_s=2,
                           **FAKES)
    with Cluster(config) as cluster:
        out = io.StringIO()
        supervisor = Supervisor(cluster, FAST, out=out)
        victim = cluster.workers[1]
        os.kill(victim.pid, getattr(signal, fault))
        supervise_until(supervisor, lambda: "restarted decode-0" in out.getvalue())
        new = cluster.workers[1]
        assert new.pid != victim.pid and new.alive() and new.ready()
        assert new.address == victim.address  # same port: the router's list stays right
        assert not victim.alive()
        assert cluster.workers[0].alive() and supervisor.restarts == 1
        reason = "exited with status -9" if fault == "SIGKILL" else "answered no health check"
        assert f"warning: decode-0 ({victim.address}) {reason}" in out.getvalue()
