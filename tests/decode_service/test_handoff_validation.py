"""Every way a handoff can be wrong gets its status from a real decode service, and leaks nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from common import convert
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.handoff.parts import ChunkPart, TrailerPart
from common.handoff.payload import HandoffPayload
from common.handoff.stream import split_payload
from common.model.load import load_model, weights_identity
from common.pb.flashsplit.v1 import decode_pb2, decode_pb2_grpc, types_pb2
from common.request_spec import RequestSpec
from common.sampling import SamplingParams
from prefill_service.handoff_sender import send_handoff
from decode_service.server import build_decode_service

PAGE = 4
NUM_PAGES = 24  # 23 usable


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


class DecodeHarness:
    """A decode service on 127.0.0.1 in this process, with a stub and its expected layout."""

    def __init__(self, model, **service_args) -> None:
        self.model = model
        self.service_args = service_args  # build_decode_service's keywords

    async def __aenter__(self):
        config = EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=NUM_PAGES, num_slots=5))
        self.layout = LayoutDescriptor.from_model(self.model.config, PAGE, self.model.dtype)
        self.fingerprint = model_fingerprint(self.model.config, weights_identity("tiny"))
        self.service = build_decode_service(LLMEngine(self.model, config), self.layout,
                                            self.fingerprint, max_handoff_bytes=1 << 30,
                                            **self.service_args)
        await self.service.server.start()
        self.channel = grpc.aio.insecure_channel(self.service.address)
        self.stub = decode_pb2_grpc.DecodeStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.service.stop()

    async def free(self) -> tuple[int, int]:
        load = await self.stub.GetLoad(types_pb2.LoadRequest(), timeout=5)
        return load.free_pages, load.free_slots

    def payload(self, prompt_len=9, max_new_tokens=4, handoff_id=77,
                speculative=None) -> HandoffPayload:
        gen = torch.Generator().manual_seed(prompt_len)
        fields = {}
        for name in ("kv", "conv_state", "ssm_state"):
            shape = self.layout.field_shape(name, prompt_len)
            dtype = getattr(torch, self.layout.field_dtype(name))
            fields[name] = torch.randn(shape, generator=gen).to(dtype)
        return HandoffPayload(
            handoff_id=handoff_id, fingerprint=self.fingerprint, layout=self.layout,
            spec=RequestSpec("", tuple(range(1, prompt_len + 1)), SamplingParams(
                temperature=0.0, max_new_tokens=max_new_tokens, speculative=speculative)),
            first_token=5, fields=fields)

    async def send(self, parts) -> None:
        await send_handoff(self.stub, [convert.handoff_part_to_pb(p) for p in parts],
                           timeout_s=10)


def run(coro):
    return asyncio.run(coro)


def mutate(parts, kind):
    """Parts of a valid handoff, broken in one way."""
    header, *chunks, trailer = parts
    if kind == "unknown_field":
        return [header, *chunks, ChunkPart("bogus", 0, 0, b"x"), trailer]
    if kind == "oversized_chunk":
        c = chunks[0]
        return [header, ChunkPart(c.field, c.layer, c.offset, c.data + b"\0" * 64), *chunks[1:],
                trailer]
    if kind == "layer_out_of_range":
        c = chunks[0]
        return [header, ChunkPart(c.field, 99, 0, c.data), *chunks, trailer]
    if kind == "duplicate_chunk":
        return [header, chunks[0], *chunks, trailer]
    if kind == "missing_chunk":
        return [header, *chunks[1:], trailer]
    if kind == "bad_checksum":
        sums = dict(trailer.checksums)
        sums["ssm_state"] ^= 1
        return [header, *chunks, TrailerPart(sums, first_token=5)]
    if kind == "corrupted_bytes":
        c = chunks[-1]
        flipped = bytes([c.data[0] ^ 0xFF]) + c.data[1:]
        return [header, *chunks[:-1], ChunkPart(c.field, c.layer, c.offset, flipped), trailer]
    if kind == "no_trailer":
        return [header, *chunks]
    if kind == "no_header":
        return [*chunks, trailer]
    if kind == "fingerprint":
        return [dataclasses.replace(header, fingerprint="0" * 64), *chunks, trailer]
    if kind == "layout":
        layout = dataclasses.replace(header.layout, page_size=header.layout.page_size * 2)
        return [dataclasses.replace(header, layout=layout), *chunks, trailer]
    if kind == "wrong_shape_manifest":
        manifest = dict(header.manifest)
        spec = manifest["conv_state"]
        manifest["conv_state"] = dataclasses.replace(spec, shape=(spec.shape[0] + 1,
                                                                  *spec.shape[1:]))
        return [dataclasses.replace(header, manifest=manifest), *chunks, trailer]
    raise ValueError(kind)


EXPECTED = {
    "unknown_field": grpc.StatusCode.INVALID_ARGUMENT,
    "oversized_chunk": grpc.StatusCode.INVALID_ARGUMENT,
    "layer_out_of_range": grpc.StatusCode.INVALID_ARGUMENT,
    "duplicate_chunk": grpc.StatusCode.INVALID_ARGUMENT,
    "wrong_shape_manifest": grpc.StatusCode.INVALID_ARGUMENT,
    "no_header": grpc.StatusCode.INVALID_ARGUMENT,
    "missing_chunk": grpc.StatusCode.DATA_LOSS,
    "bad_checksum": grpc.StatusCode.DATA_LOSS,
    "corrupted_bytes": grpc.StatusCode.DATA_LOSS,
    "no_trailer": grpc.StatusCode.DATA_LOSS,
    "fingerprint": grpc.StatusCode.FAILED_PRECONDITION,
    "layout": grpc.StatusCode.FAILED_PRECONDITION,
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_invalid_handoff_gets_its_status_and_frees_everything(tiny, kind):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            parts = list(split_payload(h.payload(), chunk_bytes=700))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.send(mutate(parts, kind))
            assert err.value.code() == EXPECTED[kind], err.value.details()
            assert await h.free() == before
            # the worker still takes a valid handoff afterwards
            await h.send(split_payload(h.payload(handoff_id=78), chunk_bytes=700))
    run(scenario())


def test_valid_handoff_decodes_and_returns_its_room(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            stream = h.stub.Stream(decode_pb2.StreamRequest(handoff_id=77), timeout=30)
            await h.send(split_payload(h.payload(max_new_tokens=6)))
            tokens = []
            async for event in stream:
                tokens.extend(event.token_ids)
            assert tokens[0] == 5 and len(tokens) == 6
            assert await h.free() == before
    run(scenario())


def test_resource_exhausted_when_pages_run_out(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            # 9 + 80 tokens need 23 pages of 4: the whole pool, so a second one cannot fit
            await h.send(split_payload(h.payload(max_new_tokens=80, handoff_id=1)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.send(split_payload(h.payload(max_new_tokens=4, handoff_id=2)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as err:  # can never fit
                await h.send(split_payload(h.payload(max_new_tokens=500, handoff_id=3)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await h.stub.Abort(types_pb2.AbortRequest(handoff_id=1), timeout=5)
            assert await h.free() == before
    run(scenario())


def test_handoff_for_an_aborted_request_is_refused_and_freed(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            await h.stub.Abort(types_pb2.AbortRequest(handoff_id=77, reason="client left"),
                               timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.send(split_payload(h.payload()))
            assert err.value.code() == grpc.StatusCode.ABORTED
            assert await h.free() == before
    run(scenario())


def test_cancelled_stream_aborts_the_request(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            stream = h.stub.Stream(decode_pb2.StreamRequest(handoff_id=77), timeout=30)
            await h.send(split_payload(h.payload(max_new_tokens=80)))
            async for _ in stream:
                break
            stream.cancel()
            for _ in range(100):  # the abort reaches the engine thread asynchronously
                if await h.free() == before:
                    break
                await asyncio.sleep(0.02)
            assert await h.free() == before
            load = await h.stub.GetLoad(types_pb2.LoadRequest(), timeout=5)
            assert load.counters["aborted"] == 1  # freed by the abort, not by finishing
    run(scenario())


def test_speculative_decoding_asked_of_a_worker_without_a_draft_is_refused(tiny):
    async def scenario():
        async with DecodeHarness(tiny) as h:
            before = await h.free()
            payload = h.payload(speculative=True)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.send(split_payload(payload))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "no draft" in err.value.details() and "--draft" in err.value.details()
            assert await h.free() == before
            # left to the worker (unset), or declined, it decodes without speculation
            for handoff_id, speculative in ((78, None), (79, False)):
                await h.send(split_payload(h.payload(handoff_id=handoff_id,
                                                     speculative=speculative)))
    run(scenario())
