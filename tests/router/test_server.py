"""The Generation servicer against fake prefill and decode workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from common.tokenizer import ByteTokenizer
from router.dispatch import DispatchConfig
from router.registry import RegistryConfig
from router.server import Router, RouterConfig
from tests.router.fakes import FINGERPRINT, REPLY_IDS, REPLY_TEXT, start_fake

SC = grpc.StatusCode


@contextlib.asynccontextmanager
async def cluster(num_prefill=1, num_decode=1, max_attempts=3, extra_prefill=(),
                  extra_decode=()):
    """Fakes plus an in-process router; yields (stub, router, prefills, decodes)."""
    prefills = [await start_fake("prefill") for _ in range(num_prefill)]
    decodes = [await start_fake("decode") for _ in range(num_decode)]
    config = RouterConfig(
        model="tiny", prefill=tuple(w.address for w in prefills) + tuple(extra_prefill),
        decode=tuple(w.address for w in decodes) + tuple(extra_decode),
        # A long backoff keeps a worker marked down for the whole test.
        registry=RegistryConfig(poll_interval_s=0.05, poll_timeout_s=2.0,
                                backoff_initial_s=30.0, backoff_max_s=60.0),
        # full decode workers are waited for briefly: long enough to see room come back
        dispatch=DispatchConfig(max_attempts=max_attempts, max_queue_wait_s=1.0,
                                queue_poll_s=0.05))
    router = Router(config)
    address = await router.start()
    channel = grpc.aio.insecure_channel(address)
    try:
        yield (generation_pb2_grpc.GenerationStub(channel), router,
               [w.servicer for w in prefills], [w.servicer for w in decodes])
    finally:
        await channel.close()
        await router.stop(0)
        for w in prefills + decodes:
            await w.stop()


def request(text=None, ids=None, request_id="", **sampling):
    req = generation_pb2.GenerateRequest(request_id=request_id,
                                         sampling=types_pb2.SamplingParams(**sampling))
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.text = text
    return req


async def collect(stub, req, timeout=5.0):
    return [m async for m in stub.Generate(req, timeout=timeout)]


async def wait_for(predicate, timeout=2.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_stream_text_deltas_concatenate_to_the_full_text():
    async def body():
        async with cluster() as (stub, _, (prefill,), _):
            msgs = await collect(stub, request("Hi", request_id="r-1", max_new_tokens=200))
            assert all(m.request_id == "r-1" for m in msgs)
            ids = [t for m in msgs for t in m.token_ids]
            assert tuple(ids) == REPLY_IDS
            assert "".join(m.text for m in msgs) == REPLY_TEXT == ByteTokenizer().decode(ids)
            assert all("\ufffd" not in m.text for m in msgs)  # never a split character
            assert all(m.finish_reason == 0 for m in msgs[:-1])
            last = msgs[-1]
            assert last.finish_reason == types_pb2.FINISH_REASON_STOP
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, len(ids))
            t = last.timings
            assert 0 < t.time_to_first_token_s <= t.total_s
            assert len(t.inter_token_latencies_s) == len(ids) - 1
            assert t.prefill_s == pytest.approx(0.002)
            # The router tokenized the text and resolved every sampling field.
            call = prefill.calls[0]
            assert list(call.prompt_token_ids) == list(b"Hi")
            assert call.request_id == "r-1" and call.sampling.HasField("seed")
            assert call.sampling.max_new_tokens == 200 and call.sampling.temperature == 1.0
    asyncio.run(body())


def test_multi_token_events_have_zero_gaps_and_accept_lengths():
    async def body():
        async with cluster() as (stub, _, _, (decode,)):
            decode.knobs.tokens_per_event = 4
            msgs = await collect(stub, request(ids=[1, 2, 3], max_new_tokens=9))
            assert [len(m.token_ids) for m in msgs] == [1, 4, 4]
            assert [list(m.accept_lengths) for m in msgs] == [[], [4], [4]]
            gaps = msgs[-1].timings.inter_token_latencies_s
            assert len(gaps) == 8 and [g == 0 for g in gaps] == [False, True, True, True] * 2
            assert msgs[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    asyncio.run(body())


def test_default_max_new_tokens_comes_from_sampling_params():
    async def body():
        async with cluster() as (stub, _, (prefill,), _):
            msgs = await collect(stub, request("x"))
            assert sum(len(m.token_ids) for m in msgs) == 16
            assert prefill.calls[0].sampling.max_new_tokens == 16
            assert not prefill.calls[0].sampling.HasField("speculative")
    asyncio.run(body())


def test_generate_once_returns_everything_in_one_message():
    async def body():
        async with cluster() as (stub, _, _, _):
            resp = await stub.GenerateOnce(request("Hi", max_new_tokens=200), timeout=5)
            assert resp.text == REPLY_TEXT and tuple(resp.token_ids) == REPLY_IDS
            assert resp.finish_reason == types_pb2.FINISH_REASON_STOP
            assert resp.usage.completion_tokens == len(REPLY_IDS)
            assert len(resp.timings.inter_token_latencies_s) == len(REPLY_IDS) - 1
            assert resp.request_id.startswith("req-")
    asyncio.run(body())


def test_first_token_only_request_skips_decode():
    async def body():
        async with cluster() as (stub, _, _, (decode,)):
            msgs = await collect(stub, request("Hi", max_new_tokens=1))
            assert len(msgs) == 1 and list(msgs[0].token_ids) == [REPLY_IDS[0]]
            assert msgs[0].text == "H" and msgs[0].finish_reason == types_pb2.FINISH_REASON_LENGTH
            assert msgs[0].timings.inter_token_latencies_s == []
            await wait_for(lambda: decode.cancelled_streams)  # its waiting Stream was cancelled
    asyncio.run(body())


def test_retry_after_prefill_unavailable_lands_on_the_other_worker():
    async def body():
        async with cluster(num_prefill=2) as (stub, router, (bad, good), (decode,)):
            bad.knobs.fail_with = SC.UNAVAILABLE
            good.knobs.queue_len = 5  # so the failing worker is chosen first
            await asyncio.sleep(0.15)  # let the registry see the queue
            msgs = await collect(stub, request("Hi", max_new_tokens=200))
            assert "".join(m.text for m in msgs) == REPLY_TEXT
            assert len(bad.calls) == 1 and len(good.calls) == 1
            assert bad.calls[0].handoff_id != good.calls[0].handoff_id  # a new handoff id
            assert not router.registry.get(bad.address).healthy
            # The failed attempt's reservation on decode is released.
            await wait_for(lambda: bad.calls[0].handoff_id in decode.aborts)
            listing = await stub.ListWorkers(generation_pb2.ListWorkersRequest())
            row = next(w for w in listing.workers if w.address == bad.address)
            assert not row.healthy and "UNAVAILABLE" in row.last_error
    asyncio.run(body())


def test_retry_after_decode_refusal_goes_to_the_other_decode_worker():
    async def body():
        async with cluster(num_decode=2) as (stub, router, (prefill,), (full, roomy)):
            full.knobs.refuse_with = SC.RESOURCE_EXHAUSTED
            full.knobs.free_slots, roomy.knobs.free_slots = 8, 2  # the full one looks best
            await asyncio.sleep(0.15)
            msgs = await collect(stub, request("Hi", max_new_tokens=5))
            assert sum(len(m.token_ids) for m in msgs) == 5
            assert [c.decode_address for c in prefill.calls] == [full.address, roomy.address]
            assert router.registry.get(full.address).healthy  # full is not down
    asyncio.run(body())


def test_every_decode_worker_full_is_resource_exhausted():
    async def body():
        async with cluster(num_decode=2) as (stub, router, (prefill,), decoders):
            for d in decoders:
                d.knobs.refuse_with = SC.RESOURCE_EXHAUSTED
            await asyncio.sleep(0.15)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request("Hi", max_new_tokens=5))
            assert err.value.code() == SC.RESOURCE_EXHAUSTED  # workers are up, just full
            assert "every decode worker is full; waited" in err.value.details()
            assert "unhealthy" not in err.value.details()
            assert all(router.registry.get(d.address).healthy for d in decoders)
    asyncio.run(body())


def test_a_request_no_decode_worker_can_serve_is_failed_precondition():
    """e.g. speculative decoding asked for where no decode worker has a draft: each refuses
    (FAILED_PRECONDITION), and the client hears that, not UNAVAILABLE."""
    async def body():
        async with cluster(num_decode=2) as (stub, router, (prefill,), decoders):
            for d in decoders:
                d.knobs.refuse_with = SC.FAILED_PRECONDITION
            await asyncio.sleep(0.15)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request("Hi", max_new_tokens=5, speculative=True))
            assert err.value.code() == SC.FAILED_PRECONDITION, err.value.details()
            assert sorted(c.decode_address for c in prefill.calls) == \
                sorted(d.address for d in decoders)  # each tried once
            assert all(router.registry.get(d.address).healthy for d in decoders)
    asyncio.run(body())


def test_a_request_waits_while_every_decode_worker_is_full():
    async def body():
        async with cluster(num_decode=1) as (stub, router, (prefill,), (decode,)):
            decode.knobs.refuse_with = SC.RESOURCE_EXHAUSTED
            await asyncio.sleep(0.15)
            pending = asyncio.ensure_future(collect(stub, request("Hi", max_new_tokens=5)))
            await wait_for(lambda: len(prefill.calls) >= 2)  # refused, and tried again
            assert not pending.done()
            decode.knobs.refuse_with = None  # room again
            msgs = await asyncio.wait_for(pending, 5)
            assert sum(len(m.token_ids) for m in msgs) == 5
    asyncio.run(body())


def test_stream_broken_before_first_token_retries_and_marks_decode_down():
    async def body():
        async with cluster(num_decode=2) as (stub, router, _, (broken, ok)):
            broken.knobs.break_after = 0
            broken.knobs.free_slots, ok.knobs.free_slots = 8, 2
            await asyncio.sleep(0.15)
            msgs = await collect(stub, request("Hi", max_new_tokens=5))
            assert sum(len(m.token_ids) for m in msgs) == 5
            assert len(ok.streams) == 1
            assert not router.registry.get(broken.address).healthy
    asyncio.run(body())


def test_failure_after_first_token_is_unavailable_promptly():
    async def body():
        async with cluster(num_decode=2) as (stub, _, _, (d1, d2)):
            for d in (d1, d2):
                d.knobs.break_after = 3
            got = []
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for m in stub.Generate(request("Hi", max_new_tokens=50), timeout=10):
                    got.extend(m.token_ids)
            assert time.monotonic() - start < 2.0
            assert err.value.code() == SC.UNAVAILABLE
            assert "failed after 3 tokens" in err.value.details()
            assert tuple(got) == REPLY_IDS[:3]
            assert len(d1.streams) + len(d2.streams) == 1  # no retry after the first token
    asyncio.run(body())


def test_all_attempts_failing_gives_unavailable_naming_the_worker():
    async def body():
        async with cluster() as (stub, _, (prefill,), _):
            prefill.knobs.fail_with = SC.INTERNAL
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request("Hi"))
            assert err.value.code() == SC.UNAVAILABLE
            assert prefill.address in err.value.details() and "INTERNAL" in err.value.details()
    asyncio.run(body())


def test_prefill_invalid_argument_is_passed_through_without_retry():
    async def body():
        async with cluster(num_prefill=2) as (stub, _, prefills, _):
            for p in prefills:
                p.knobs.fail_with = SC.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request("Hi"))
            assert err.value.code() == SC.INVALID_ARGUMENT
            assert sum(len(p.calls) for p in prefills) == 1
    asyncio.run(body())


def test_unreachable_workers_give_unavailable():
    async def body():
        async with cluster(num_prefill=0, extra_prefill=("127.0.0.1:1",)) as (stub, _, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request("Hi"))
            assert err.value.code() == SC.UNAVAILABLE
            assert "127.0.0.1:1" in err.value.details()
    asyncio.run(body())


def test_client_cancellation_aborts_on_both_workers():
    async def body():
        async with cluster() as (stub, _, (prefill,), (decode,)):
            decode.knobs.event_delay_s = 0.1
            call = stub.Generate(request("Hi", max_new_tokens=200), timeout=10)
            await call.read()
            await call.read()
            call.cancel()
            hid = prefill.calls[0].handoff_id
            await wait_for(lambda: hid in prefill.aborts and hid in decode.aborts)
            assert hid in decode.cancelled_streams
    asyncio.run(body())


def test_a_request_that_finishes_aborts_nothing():
    """The router stops reading at the chunk with the finish reason; that is no cancellation."""
    async def body():
        async with cluster() as (stub, _, (prefill,), (decode,)):
            await collect(stub, request("Hi", max_new_tokens=5))
            await asyncio.sleep(0.2)  # time for an abort that would have been sent
            assert len(prefill.calls) == 1
            assert prefill.aborts == [] and decode.aborts == []
    asyncio.run(body())


def test_client_deadline_aborts_on_both_workers():
    async def body():
        async with cluster() as (stub, _, (prefill,), (decode,)):
            decode.knobs.event_delay_s = 0.1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, request("Hi", max_new_tokens=200), timeout=0.5)
            assert err.value.code() == SC.DEADLINE_EXCEEDED
            hid = prefill.calls[0].handoff_id
            await wait_for(lambda: hid in prefill.aborts and hid in decode.aborts)
    asyncio.run(body())


@pytest.mark.parametrize("req", [
    request(""),
    request(ids=[]),
    request(ids=[1, 260]),
    generation_pb2.GenerateRequest(),
    request("Hi", temperature=-1.0),
    request("Hi", top_p=0.0),
    request("Hi", max_new_tokens=0),
    request("Hi", stop_token_ids=[999]),
    request("Hi", max_new_tokens=300000),
], ids=["empty-text", "empty-ids", "out-of-vocab", "no-input", "temperature", "top-p",
        "max-new-tokens", "stop-id", "context"])
def test_invalid_requests(req):
    async def body():
        async with cluster() as (stub, _, (prefill,), _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, req)
            assert err.value.code() == SC.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GenerateOnce(req, timeout=5)
            assert err.value.code() == SC.INVALID_ARGUMENT
            assert prefill.calls == []
    asyncio.run(body())


def test_model_info_and_worker_list():
    async def body():
        async with cluster(num_prefill=2) as (stub, _, prefills, (decode,)):
            info = await stub.GetModelInfo(generation_pb2.ModelInfoRequest(), timeout=5)
            assert (info.model_name, info.model_type, info.vocab_size) == ("tiny",
                                                                           "qwen3_5_text", 260)
            assert list(info.eos_token_ids) == [256] and info.model_fingerprint == FINGERPRINT
            listing = await stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5)
            kinds = [w.kind for w in listing.workers]
            assert kinds == [types_pb2.WORKER_KIND_PREFILL] * 2 + [types_pb2.WORKER_KIND_DECODE]
            addrs = [w.address for w in listing.workers]
            assert addrs[:2] == sorted(p.address for p in prefills)
            assert addrs[2] == decode.address and listing.workers[2].load.free_slots == 8
            assert all(w.healthy for w in listing.workers)
    asyncio.run(body())


def test_health_and_reflection_are_served():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def body():
        async with cluster() as (_, router, _, _):
            async with grpc.aio.insecure_channel(router.address) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="flashsplit.v1.Generation"), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
    asyncio.run(body())
