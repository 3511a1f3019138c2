"""The handoff transports through real processes: the same greedy tokens, pools full after.

On the CPU the ``device`` transport is shared memory (the decode worker copies out of the
prefill worker's pools); ``auto`` falls back to TCP where the receiver will not open them, and
to the byte stream where it takes neither; ``device`` and ``tcp`` then fail with a clear
status.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from common.model.load import load_model
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import (CHUNKED, GREEDY, generate_all, local_greedy,
                                          wait_all_free, worker_load)

PROMPTS = [[5, 17, 200], [(i * 37 + 11) % 256 for i in range(23)], list(range(1, 41))]


def run(prefill: str, decode: str, draft: bool = False):
    """``prefill`` is a transport, or ``stream+process`` for the stream written by the prefill
    worker's send process."""
    extra = ("--draft", "tiny") if draft else ()
    prefill, _, sender = prefill.partition("+")
    config = ClusterConfig(model="tiny", worker_args=CHUNKED + extra,
                           prefill_args=("--handoff-transport", prefill,
                                         "--handoff-sender", sender or "auto"),
                           decode_args=("--handoff-transport", decode))
    with Cluster(config) as cluster:
        outs = asyncio.run(generate_all(cluster.router_address, PROMPTS))
        reports = asyncio.run(wait_all_free(cluster))
        (prefill_worker,) = [w for w in cluster.workers if w.kind == "prefill"]
        load = asyncio.run(worker_load(prefill_worker.address, "prefill",
                                       cluster.internal_token))
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)
    # the prefill worker's own timings reach the client: its queue (from the call's arrival,
    # the handoff's opening included), prefill and unhidden handoff, within the router's TTFT
    for o in outs:
        assert 0 < o.prefill_queue_s and 0 < o.prefill_s and 0 < o.handoff_s
        assert o.prefill_queue_s + o.prefill_s < o.time_to_first_token_s
    return outs, load.counters


@pytest.mark.parametrize("prefill,decode,path", [
    ("auto", "auto", "copies"),   # same host: pool copies
    ("device", "device", "copies"),
    ("tcp", "tcp", "tcp"),
    ("auto", "tcp", "tcp"),       # the receiver opens no pools: auto takes its TCP listener
    ("tcp", "auto", "tcp"),       # the sender offers no pools
    ("auto", "stream", "stream"),  # the receiver takes bytes on the stream only
    ("stream", "auto", "stream"),  # the sender offers neither
    ("stream+process", "auto", "stream"),  # its send process writes the stream
])
def test_transports_give_the_same_tokens(prefill, decode, path):
    outs, counters = run(prefill, decode)
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)
    assert counters["handoffs_sent"] == len(PROMPTS)
    # on the CPU only --handoff-sender process starts one
    by_process = prefill.endswith("+process")
    assert counters["handoffs_by_send_process"] == (len(PROMPTS) if by_process else 0)
    assert counters["send_process_starts"] == int(by_process)
    assert counters["handoffs_as_pool_copies"] == (len(PROMPTS) if path == "copies" else 0)
    assert counters["handoffs_over_tcp"] == (len(PROMPTS) if path == "tcp" else 0)
    # copies move no payload bytes
    assert (counters["handoff_bytes"] > 10_000) == (path != "copies")


def test_device_transport_carries_the_draft_context():
    """DFLASH is lossless: with the draft context copied over, greedy output is plain greedy,
    and every token after the first comes from a speculative step."""
    outs, counters = run("device", "auto", draft=True)
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)
    assert all(o.accept_lengths and sum(o.accept_lengths) >= len(o.token_ids) - 1
               for o in outs)
    assert counters["handoffs_as_pool_copies"] == len(PROMPTS)


def test_tcp_transport_carries_the_draft_context():
    outs, counters = run("tcp", "tcp", draft=True)
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)
    assert all(o.accept_lengths and sum(o.accept_lengths) >= len(o.token_ids) - 1
               for o in outs)
    assert counters["handoffs_over_tcp"] == len(PROMPTS)


def test_the_send_process_carries_the_draft_context():
    outs, counters = run("stream+process", "stream", draft=True)
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)
    assert all(o.accept_lengths and sum(o.accept_lengths) >= len(o.token_ids) - 1
               for o in outs)
    assert counters["handoffs_sent"] == len(PROMPTS) and counters["handoff_bytes"] > 10_000
    assert counters["handoffs_by_send_process"] == len(PROMPTS)


@pytest.mark.parametrize("transport", ["device", "tcp", "stream"])
def test_a_decode_worker_past_its_speculation_limit_declines_the_draft_context(transport):
    """--speculative-disable-by-batch-size 1: while one request decodes, the next ones decode
    without the draft. The decode worker says so when it accepts their handoffs, and the
    prefill worker neither makes nor sends their draft context, on every transport: the same
    tokens, pools full after."""
    config = ClusterConfig(model="tiny", worker_args=CHUNKED + ("--draft", "tiny"),
                           prefill_args=("--handoff-transport", transport),
                           decode_args=("--handoff-transport", transport,
                                        "--speculative-disable-by-batch-size", "1"))
    long = replace(GREEDY, max_new_tokens=400)

    async def scenario(cluster):
        (decode,) = [w for w in cluster.workers if w.kind == "decode"]
        holder = asyncio.ensure_future(generate(cluster.router_address,
                                                request_to_pb(token_ids=[7, 8, 9], params=long)))
        while (await worker_load(decode.address, "decode", cluster.internal_token)).running < 1:
            await asyncio.sleep(0.01)
        outs = await generate_all(cluster.router_address, PROMPTS)
        return await holder, outs

    with Cluster(config) as cluster:
        holder, outs = asyncio.run(scenario(cluster))
        reports = asyncio.run(wait_all_free(cluster))
        (prefill,) = [w for w in cluster.workers if w.kind == "prefill"]
        counters = asyncio.run(worker_load(prefill.address, "prefill",
                                           cluster.internal_token)).counters
    assert counters["draft_contexts_declined"] == len(PROMPTS)
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS)
    assert all(not o.accept_lengths for o in outs)  # plain decode steps only
    assert holder.accept_lengths  # the first one speculated
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)


@pytest.mark.parametrize("prefill,decode,message", [
    ("device", "stream", "cannot open this worker's pools"),
    ("tcp", "stream", "takes no chunks over TCP"),
])
def test_a_transport_without_a_willing_receiver_fails_clearly(prefill, decode, message):
    config = ClusterConfig(model="tiny", worker_args=CHUNKED,
                           prefill_args=("--handoff-transport", prefill),
                           decode_args=("--handoff-transport", decode))
    with Cluster(config) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(generate_all(cluster.router_address, PROMPTS[:1]))
        assert message in err.value.details()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        reports = asyncio.run(wait_all_free(cluster))
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)
