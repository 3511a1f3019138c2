"""A caller without the cluster's internal token gets nothing from its workers.

Real processes on 127.0.0.1 (`Cluster`: router, a prefill and a decode worker, with the random
token `flashsplit up` generates). Each internal RPC is tried without a token and with a wrong
one: UNAUTHENTICATED, nothing held, and a prefill worker never connects to the address the
forger names. With the token the same calls go through, which shows it is the token, not
the forgery's shape, that stops them. Afterwards the cluster serves exact greedy output.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from common import convert
from common.channels import ChannelSecurity, make_channel
from common.handoff.layout import LayoutDescriptor
from common.handoff.payload import HandoffPayload, new_handoff_id
from common.handoff.stream import split_payload
from common.healthcheck import check
from common.model.load import load_model
from common.pb.flashsplit.v1 import (decode_pb2, decode_pb2_grpc, prefill_pb2,
                                     prefill_pb2_grpc, types_pb2)
from common.request_spec import RequestSpec
from common.sampling import SamplingParams
from prefill_service.handoff_sender import send_handoff
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import PAGE, WORKER_ARGS, local_greedy, wait_all_free

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
WRONG = "w" * 43


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterConfig(model="tiny", worker_args=WORKER_ARGS)) as cluster:
        yield cluster


def worker(cluster, kind: str):
    return next(w for w in cluster.workers if w.kind == kind)


def forged_payload(fingerprint: str, prompt_len: int = 6) -> HandoffPayload:
    """A handoff that fits the tiny model's layout exactly: decode would accept it."""
    model = load_model("tiny")
    layout = LayoutDescriptor.from_model(model.config, PAGE, model.dtype)
    gen = torch.Generator().manual_seed(1)
    fields = {name: torch.randn(layout.field_shape(name, prompt_len), generator=gen)
              .to(getattr(torch, layout.field_dtype(name)))
              for name in ("kv", "conv_state", "ssm_state")}
    return HandoffPayload(
        handoff_id=new_handoff_id(), fingerprint=fingerprint, layout=layout,
        spec=RequestSpec("", tuple(range(1, prompt_len + 1)),
                         SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)),
        first_token=7, fields=fields)


async def code_of(awaitable) -> grpc.StatusCode:
    try:
        await awaitable
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def stream_code(call) -> grpc.StatusCode:
    async def drain():
        async for _ in call:
            pass
    return await code_of(drain())


def channels(address: str):
    """(no token, wrong token) channels to ``address``."""
    return make_channel(address), make_channel(address, ChannelSecurity.internal(WRONG))


def test_every_internal_rpc_without_the_token_is_unauthenticated(cluster):
    decode, prefill = worker(cluster, "decode"), worker(cluster, "prefill")
    start = [(r.free_pages, r.free_slots) for r in asyncio.run(wait_all_free(cluster))]

    async def scenario():
        async with cluster.worker_channel(decode.address) as ok:
            fingerprint = (await decode_pb2_grpc.DecodeStub(ok).GetLoad(
                types_pb2.LoadRequest(), timeout=5)).model_fingerprint
        payload = forged_payload(fingerprint)
        messages = [convert.handoff_part_to_pb(p) for p in split_payload(payload)]
        for channel in channels(decode.address):
            async with channel:
                stub = decode_pb2_grpc.DecodeStub(channel)
                assert await code_of(send_handoff(stub, messages, timeout_s=10)) == UNAUTH
                read = stub.Stream(decode_pb2.StreamRequest(handoff_id=payload.handoff_id),
                                   timeout=10)
                assert await stream_code(read) == UNAUTH
                abort = types_pb2.AbortRequest(handoff_id=payload.handoff_id, reason="forged")
                assert await code_of(stub.Abort(abort, timeout=5)) == UNAUTH
                assert await code_of(stub.GetLoad(types_pb2.LoadRequest(), timeout=5)) == UNAUTH
        for channel in channels(prefill.address):
            async with channel:
                stub = prefill_pb2_grpc.PrefillStub(channel)
                assert await code_of(stub.GetLoad(types_pb2.LoadRequest(), timeout=5)) == UNAUTH
                assert await code_of(stub.Abort(types_pb2.AbortRequest(handoff_id=1),
                                                timeout=5)) == UNAUTH
        # the refused handoff held nothing
        free = [(r.free_pages, r.free_slots) for r in await wait_all_free(cluster)]
        assert free == start
        # with the token the very same forgery is accepted and its tokens can be read: only
        # the token stood between a forger and the decode worker
        async with cluster.worker_channel(decode.address) as ok:
            stub = decode_pb2_grpc.DecodeStub(ok)
            ack = await send_handoff(stub, messages, timeout_s=10)
            assert ack.handoff_id == payload.handoff_id
            events = [e async for e in stub.Stream(
                decode_pb2.StreamRequest(handoff_id=payload.handoff_id), timeout=30)]
            assert sum(len(e.token_ids) for e in events) == 3

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [(r.free_pages, r.free_slots) for r in asyncio.run(wait_all_free(cluster))] == start


def test_a_prefill_worker_never_dials_an_address_an_unauthenticated_caller_names(cluster):
    prefill = worker(cluster, "prefill")

    async def scenario():
        dialed: list[object] = []

        async def on_connect(reader, writer):  # a trap: anything that connects is counted
            dialed.append(writer.get_extra_info("peername"))
            writer.close()

        trap = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        trap_address = "127.0.0.1:%d" % trap.sockets[0].getsockname()[1]
        request = prefill_pb2.PrefillRequest(
            handoff_id=new_handoff_id(), prompt_token_ids=[1, 2, 3],
            sampling=convert.sampling_to_pb(SamplingParams(temperature=0.0, max_new_tokens=4)),
            decode_address=trap_address)
        try:
            for channel in channels(prefill.address):
                async with channel:
                    stub = prefill_pb2_grpc.PrefillStub(channel)
                    assert await stream_code(stub.Prefill(request, timeout=10)) == UNAUTH
            await asyncio.sleep(0.3)  # long enough for a dial that was going to happen
            assert dialed == []
            # a token holder (the router) does choose the address: the worker dials it
            async with cluster.worker_channel(prefill.address) as ok:
                code = await stream_code(prefill_pb2_grpc.PrefillStub(ok).Prefill(request,
                                                                                  timeout=20))
            assert code != grpc.StatusCode.OK and dialed
        finally:
            trap.close()
            await trap.wait_closed()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_health_stays_open_and_the_cluster_still_serves(cluster):
    for w in cluster.workers:
        assert check(w.address)  # orchestrators probe without a secret
    assert check(cluster.router_address)
    prompts = [[5, 6, 7], [(3 * j) % 256 for j in range(17)]]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)

    async def run():
        return await asyncio.gather(*[generate(cluster.router_address,
                                               request_to_pb(token_ids=p, params=params))
                                      for p in prompts])

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), prompts, params)
