"""Faults while a handoff streams during the prefill: nothing stays reserved on either side.

The decode worker reserves when the request is dispatched and the prefill worker streams while
it computes, so each of these happens with a live handoff: the client gives up mid-prefill,
the prefill worker dies mid-stream, the decode worker dies mid-stream. Real processes on
127.0.0.1; a long prompt in small chunks keeps the prefill (and its stream) going for a while.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import PAGE, worker_load

LONG_PROMPT = [(7 * i + 3) % 256 for i in range(1500)]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
ARGS = ("--page-size", str(PAGE), "--num-pages", "1024", "--max-prefill-tokens", "6")


def config(transport: str) -> ClusterConfig:
    """``transport``, or ``stream+process``: the stream written by the prefill worker's send
    process (prefill_service/send_process.py)."""
    name, _, sender = transport.partition("+")
    return ClusterConfig(model="tiny", worker_args=ARGS + ("--handoff-transport", name),
                         prefill_args=("--handoff-sender", sender or "thread"),
                         router_args=("--poll-interval", "0.2"))


def worker(cluster, kind: str):
    return next(w for w in cluster.workers if w.kind == kind)


def load(cluster, kind: str):
    return asyncio.run(worker_load(worker(cluster, kind).address, kind, cluster.internal_token))


def wait_free(cluster, kind: str, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        r = load(cluster, kind)
        if (r.free_pages == r.total_pages and r.free_slots == r.total_slots) \
                or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def wait_reserved(cluster, timeout_s: float = 15.0) -> None:
    """Until the decode worker holds room for the long prompt (its handoff is streaming)."""
    deadline = time.monotonic() + timeout_s
    while load(cluster, "decode").free_slots == load(cluster, "decode").total_slots:
        assert time.monotonic() < deadline, "the handoff never reserved"
        time.sleep(0.01)


def start_long(cluster) -> asyncio.Future:
    return asyncio.ensure_future(generate(
        cluster.router_address, request_to_pb(token_ids=LONG_PROMPT, params=PARAMS),
        timeout_s=60))


@pytest.mark.parametrize("transport", ["stream", "stream+process", "tcp", "device"])
def test_a_client_that_gives_up_mid_prefill_frees_both_workers(transport):
    with Cluster(config(transport)) as cluster:
        async def scenario():
            call = start_long(cluster)
            await asyncio.to_thread(wait_reserved, cluster)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)

        asyncio.run(scenario())
        for kind in ("prefill", "decode"):
            r = wait_free(cluster, kind)
            assert (r.free_pages, r.free_slots) == (r.total_pages, r.total_slots), kind
        prefill = load(cluster, "prefill")
        assert prefill.counters["handoffs_sent"] == 0  # it was stopped, not run to the end


def kill_mid_stream(cluster, kind: str) -> None:
    """SIGKILL the ``kind`` worker while the long prompt's handoff streams; the request fails."""
    async def scenario():
        call = start_long(cluster)
        await asyncio.to_thread(wait_reserved, cluster)
        worker(cluster, kind).popen.send_signal(signal.SIGKILL)
        return await asyncio.gather(call, return_exceptions=True)

    (result,) = asyncio.run(scenario())
    assert isinstance(result, grpc.aio.AioRpcError)


@pytest.mark.parametrize("transport", ["stream", "stream+process", "tcp", "device"])
def test_a_prefill_worker_that_dies_mid_stream_leaves_nothing_on_decode(transport):
    with Cluster(config(transport)) as cluster:
        kill_mid_stream(cluster, "prefill")
        r = wait_free(cluster, "decode")
        assert (r.free_pages, r.free_slots) == (r.total_pages, r.total_slots)


@pytest.mark.parametrize("transport", ["stream", "stream+process", "tcp"])
def test_a_decode_worker_that_dies_mid_stream_stops_and_frees_the_prefill(transport):
    with Cluster(config(transport)) as cluster:
        kill_mid_stream(cluster, "decode")
        r = wait_free(cluster, "prefill")
        assert (r.free_pages, r.free_slots) == (r.total_pages, r.total_slots)
        # stopped (by its broken stream, or by the router's abort once decode's token stream
        # broke), not run to the end
        assert r.counters["handoffs_sent"] == 0


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_send_process_that_dies_mid_stream_fails_the_request_and_frees_both_workers():
    """The prefill worker's send process killed while it writes a handoff: that request fails,
    neither worker holds anything, and the next request goes through a new send process."""
    with Cluster(config("stream+process")) as cluster:
        (sender,) = children_of(worker(cluster, "prefill").pid)

        async def scenario():
            call = start_long(cluster)
            await asyncio.to_thread(wait_reserved, cluster)
            os.kill(sender, signal.SIGKILL)
            return await asyncio.gather(call, return_exceptions=True)

        (result,) = asyncio.run(scenario())
        assert isinstance(result, grpc.aio.AioRpcError)
        assert "send process exited" in result.details(), result.details()
        for kind in ("prefill", "decode"):
            r = wait_free(cluster, kind)
            assert (r.free_pages, r.free_slots) == (r.total_pages, r.total_slots), kind
        # the router took the prefill worker out for its UNAVAILABLE answer until its next
        # poll (0.2 s) finds it serving
        time.sleep(1.0)
        done = asyncio.run(generate(cluster.router_address,
                                    request_to_pb(token_ids=LONG_PROMPT[:40], params=PARAMS),
                                    timeout_s=60))
        assert len(done.token_ids) == PARAMS.max_new_tokens
        # the dead one was reaped (no zombie left), a new one runs
        (again,) = children_of(worker(cluster, "prefill").pid)
        assert again != sender
        counters = load(cluster, "prefill").counters
        assert counters["send_process_starts"] == 2 and counters["handoffs_by_send_process"] == 1
