"""common/request_guard.py: unparseable and oversized requests answer INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.pb.flashsplit.v1 import types_pb2
from tests.common.toy_service import start_toy, stub

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# field 1 (uint64) with a varint that never ends: not a message at all
TRUNCATED = b"\x08\xff\xff"
# field 2 (string ``reason``) holding bytes that are not UTF-8, which proto3 refuses
BAD_UTF8 = b"\x12\x02\xff\xfe"


def run(scenario, **toy_args):
    async def main():
        server, toy, address, _ = await start_toy(**toy_args)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                return await scenario(channel, toy)
        finally:
            await server.stop(0)

    return asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("data", [TRUNCATED, BAD_UTF8], ids=["truncated", "bad-utf8"])
def test_unparseable_request_of_every_method_kind_is_invalid_argument(data):
    async def scenario(channel, toy):
        errors = []
        calls = [
            lambda: stub(channel, "Sleep", "uu", raw=True)(data, timeout=5),
            lambda: _drain(stub(channel, "Ticks", "us", raw=True)(data, timeout=5)),
            lambda: stub(channel, "Count", "su", raw=True)(
                _aiter([types_pb2.AbortRequest(handoff_id=1).SerializeToString(), data]),
                timeout=5),
            lambda: _drain(stub(channel, "Echo", "ss", raw=True)(_aiter([data]), timeout=5)),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            errors.append(err.value)
        assert toy.finished == []  # no servicer ran to its end on bad bytes
        return errors

    for err in run(scenario):
        assert err.code() == INVALID, err
        assert "not a valid protobuf message" in err.details()
        assert "/test.Toy/" in err.details()
        assert "Error" not in err.details() and "Exception" not in err.details()


def test_well_formed_requests_pass():
    async def scenario(channel, toy):
        r = await stub(channel, "Sleep", "uu")(types_pb2.AbortRequest(handoff_id=1), timeout=5)
        n = await stub(channel, "Count", "su")(
            _aiter([types_pb2.AbortRequest(reason="é")] * 3), timeout=5)
        ticks = await _drain(stub(channel, "Ticks", "us")(types_pb2.AbortRequest(handoff_id=2),
                                                          timeout=5))
        return r.found, n.found, len(ticks), toy.finished

    assert run(scenario) == (True, True, 2, ["sleep", "count:3", "ticks"])


def test_message_size_limit_is_invalid_argument_up_to_twice_it():
    async def scenario(channel, toy):
        call = stub(channel, "Sleep", "uu")
        ok = await call(types_pb2.AbortRequest(reason="x" * 900), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as over:
            await call(types_pb2.AbortRequest(reason="x" * 1500), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as far_over:
            await call(types_pb2.AbortRequest(reason="x" * 2500), timeout=5)
        return ok.found, over.value, far_over.value

    ok, over, far_over = run(scenario, max_message_bytes=1000)
    assert ok
    assert over.code() == INVALID and "at most 1000 are accepted" in over.details()
    # beyond gRPC's own limit (twice ours) gRPC refuses before reading the message
    assert far_over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def _drain(call):
    return [m async for m in call]


async def _aiter(items):
    for item in items:
        yield item
