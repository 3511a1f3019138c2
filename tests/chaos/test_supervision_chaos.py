"""Finding 3: `flashsplit up` replaces a worker that was killed or whose engine thread died.

Real processes on 127.0.0.1: `flashsplit up` with one prefill and one decode worker of the
built-in model (the real services, plus a SIGUSR1 hook that stops their engine threads). After
each fault the replaced worker must be back on its address, the cluster must serve exact greedy
output again (as in-process generation gives it) and every pool must be back to its starting
free counts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.model.load import load_model
from common.sampling import SamplingParams
from tests.chaos.up_process import UpProcess, generate_until_served, wait_pools_free
from tests.router.test_end_to_end import local_greedy

PROMPTS = [[3, 4, 5], [(11 * j) % 256 for j in range(21)]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
UP_ARGS = ("--quiet", "--model", "tiny", "--page-size", "4", "--num-pages", "64", "--num-slots", "9",
           "--grace", "1", "--prefill-module", "tests.chaos.stoppable_prefill",
           "--decode-module", "tests.chaos.stoppable_decode")


@pytest.fixture(scope="module")
def up():
    process = UpProcess(UP_ARGS)
    try:
        yield process.start(workers=2)
    finally:
        assert process.stop() == 0, process.output()[-3000:]


@pytest.fixture(scope="module")
def expected():
    return local_greedy(load_model("tiny"), PROMPTS, GREEDY)


def assert_recovered(up: UpProcess, expected, start_pools) -> None:
    outs = generate_until_served(up.router_address, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert wait_pools_free(up.router_address) == start_pools


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_a_sigkilled_worker_is_restarted_on_its_address(up, expected, victim):
    start = wait_pools_free(up.router_address)
    old_pid = up.pids[victim]
    at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    up.wait_for_line(rf"^warning: {victim} \({up.addresses[victim]}\) exited with status -9",
                     10, at)
    assert up.note_restart(victim, at) != old_pid
    assert_recovered(up, expected, start)


def test_a_worker_whose_engine_died_says_not_serving_exits_and_is_replaced(up, expected):
    victim = "decode-0"
    start = wait_pools_free(up.router_address)

    async def watch_it_fail() -> list[int]:
        seen = []
        async with grpc.aio.insecure_channel(up.addresses[victim]) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            seen.append((await asyncio.wait_for(watch.read(), 5)).status)
            os.kill(up.pids[victim], signal.SIGUSR1)  # its engine thread stops
            try:
                while seen[-1] == health_pb2.HealthCheckResponse.SERVING:
                    msg = await asyncio.wait_for(watch.read(), 10)
                    if msg is grpc.aio.EOF:
                        break
                    seen.append(msg.status)
            except grpc.aio.AioRpcError:  # the process went away after saying so
                pass
        return seen

    at = time.monotonic()
    seen = asyncio.run(watch_it_fail())
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
    # non-zero (ENGINE_STOPPED_EXIT), by itself, and up replaces it
    up.wait_for_line(rf"^warning: {victim} \(\S+\) exited with status 3;", 15, at)
    up.note_restart(victim, at)
    assert_recovered(up, expected, start)
