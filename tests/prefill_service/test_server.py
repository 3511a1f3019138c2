"""The Prefill servicer over a real in-process gRPC server: what it refuses before any work,
an unreachable decode worker, the first token sent ahead of the outcome, Abort of an unknown
handoff, and GetLoad."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.handoff.layout import LayoutDescriptor
from common.model.dflash import load_draft
from common.model.load import load_model
from common.pb.flashsplit.v1 import prefill_pb2, prefill_pb2_grpc, types_pb2
from prefill_service.engine import PrefillEngine
from prefill_service.handoff_sender import HandoffSender
from prefill_service.server import PrefillServicer
from prefill_service.state_reader import StateReader
from tests.ports import closed_port
from tests.router.fakes import start_fake

PAGE_SIZE, NUM_PAGES = 4, 9  # 8 usable pages: prompts of at most 32 tokens


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture
def engine(model):
    llm = LLMEngine(model, EngineConfig(
        cache=CacheConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_slots=4),
        hold_after_prefill=True))
    engine = PrefillEngine(llm, LayoutDescriptor.from_model(model.config, PAGE_SIZE, model.dtype),
                           "fp")
    engine.start()
    yield engine
    engine.stop()


@contextlib.asynccontextmanager
async def served(engine: PrefillEngine):
    """``engine`` served on a fresh port; yields a stub of it."""
    server = grpc.aio.server()
    sender = HandoffSender(StateReader(*engine.pools, chunk_bytes=1 << 16), timeout_s=10.0)
    servicer = PrefillServicer(engine, sender, "prefill:0",
                               engine.engine.model.config.vocab_size, (0,))
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield prefill_pb2_grpc.PrefillStub(channel)
    finally:
        await sender.close()
        await server.stop(None)


def call(engine: PrefillEngine, method: str, request):
    """Serve ``engine`` on a fresh port and make one call; returns the reply or the RpcError."""

    async def scenario():
        async with served(engine) as stub:
            try:
                if method != "Prefill":
                    return await getattr(stub, method)(request, timeout=30)
                # a stream of updates: the outcome is the last
                updates = [u async for u in stub.Prefill(request, timeout=30)]
                assert updates[-1].HasField("done"), updates
                return updates[-1].done
            except grpc.aio.AioRpcError as exc:
                return exc

    return asyncio.run(scenario())


def prefill_request(**over) -> prefill_pb2.PrefillRequest:
    fields = dict(handoff_id=7, prompt_token_ids=[1, 2, 3],
                  sampling=types_pb2.SamplingParams(temperature=0.0, max_new_tokens=4),
                  decode_address="127.0.0.1:1", request_id="req")
    fields.update(over)
    return prefill_pb2.PrefillRequest(**fields)


def pool_is_whole(engine: PrefillEngine, within_s: float = 10.0) -> bool:
    """Whether every page and slot is free, or becomes free within ``within_s``: the call's
    end releases its request through the engine thread (``PrefillEngine.abort``), which may
    run just after the client has read the outcome."""
    deadline = time.monotonic() + within_s
    while True:
        load = engine.load()
        if load["free_pages"] == load["total_pages"] and load["free_slots"] == load["total_slots"]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.mark.parametrize("over,match", [
    (dict(handoff_id=0), "handoff_id must not be 0"),
    (dict(prompt_token_ids=[]), "prompt is empty"),
    (dict(prompt_token_ids=[1, 10**6]), "outside the vocabulary"),
    (dict(decode_address=""), "decode_address is empty"),
    (dict(prompt_token_ids=[1] * 33), "holds at most 32"),
    (dict(request_id="x" * 10_000), "request_id may have at most"),
    (dict(sampling=types_pb2.SamplingParams(temperature=-1.0)), "temperature"),
    (dict(sampling=types_pb2.SamplingParams(top_p=0.0)), "top_p"),
])
def test_refused_before_any_work(engine, over, match):
    reply = call(engine, "Prefill", prefill_request(**over))
    assert isinstance(reply, grpc.aio.AioRpcError)
    assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in reply.details()
    assert pool_is_whole(engine) and engine.load()["queue_len"] == 0


def test_an_unreachable_decode_worker_is_unavailable_and_nothing_is_held(engine):
    reply = call(engine, "Prefill", prefill_request(decode_address=f"127.0.0.1:{closed_port()}"))
    assert isinstance(reply, grpc.aio.AioRpcError)
    assert reply.code() == grpc.StatusCode.UNAVAILABLE
    assert "handoff to 127.0.0.1:" in reply.details()
    assert pool_is_whole(engine)


def test_abort_of_an_unknown_handoff_finds_nothing(engine):
    reply = call(engine, "Abort", types_pb2.AbortRequest(handoff_id=99, reason="test"))
    assert reply.found is False


def test_get_load_reports_this_worker(engine):
    reply = call(engine, "GetLoad", types_pb2.LoadRequest())
    assert reply.kind == types_pb2.WORKER_KIND_PREFILL and reply.address == "prefill:0"
    assert reply.model_fingerprint == "fp"
    assert (reply.total_pages, reply.free_pages) == (NUM_PAGES - 1, NUM_PAGES - 1)
    assert reply.max_request_tokens == (NUM_PAGES - 1) * PAGE_SIZE


@pytest.mark.parametrize("max_new_tokens,early", [(4, True), (1, False)])
def test_the_first_token_goes_ahead_of_the_outcome_when_decode_has_more_to_do(
        engine, max_new_tokens, early):
    async def scenario():
        decode = await start_fake("decode")  # accepts any handoff and acknowledges it
        try:
            async with served(engine) as stub:
                request = prefill_request(decode_address=decode.address, sampling=types_pb2.
                                          SamplingParams(temperature=0.0,
                                                         max_new_tokens=max_new_tokens))
                return [u async for u in stub.Prefill(request, timeout=30)], decode.servicer
        finally:
            await decode.stop()

    updates, decode = asyncio.run(scenario())
    kinds = [u.WhichOneof("update") for u in updates]
    done = updates[-1].done
    if early:
        assert kinds == ["first_token", "done"]
        assert updates[0].first_token.token_id == done.first_token
        assert decode.first_tokens[7] == done.first_token  # the trailer's token is the same
    else:  # the request ended at its first token: no handoff, the outcome says so
        assert kinds == ["done"] and done.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert pool_is_whole(engine)


@pytest.mark.parametrize("declined", [False, True])
def test_a_draft_context_the_decode_worker_declines_is_neither_made_nor_sent(model, declined):
    """A decode worker that will decode the request without the draft says so in its
    acceptance: the prefill worker then prefills it without the draft's context (no
    ``extend_context``) and sends no ``dflash_context`` chunk."""
    llm = LLMEngine(model, EngineConfig(
        cache=CacheConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_slots=4),
        hold_after_prefill=True), draft=load_draft("tiny", model))
    extended = []
    extend = llm.speculator.extend_context
    llm.speculator.extend_context = lambda *a, **k: (extended.append(1), extend(*a, **k))[1]
    engine = PrefillEngine(llm, LayoutDescriptor.from_model(model.config, PAGE_SIZE, model.dtype),
                           "fp")
    engine.start()

    async def scenario():
        decode = await start_fake("decode")
        decode.servicer.knobs.without_draft_context = declined
        try:
            async with served(engine) as stub:
                request = prefill_request(decode_address=decode.address)
                return [u async for u in stub.Prefill(request, timeout=30)], decode.servicer
        finally:
            await decode.stop()

    try:
        updates, decode = asyncio.run(scenario())
        assert updates[-1].HasField("done")
        fields = decode.chunk_fields[7]
        assert {"kv", "conv_state", "ssm_state"} <= fields
        assert ("dflash_context" in fields) == (not declined)
        assert bool(extended) == (not declined)
        assert pool_is_whole(engine)
    finally:
        engine.stop()
