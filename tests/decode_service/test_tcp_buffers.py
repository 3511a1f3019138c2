"""Frames of the tcp transport in the listener's host buffers: read into the pool (pinned on a
GPU), landed from it into a reservation's pools, and every buffer back in the pool after; a
full pool, or a frame larger than it, gets a buffer of its own instead of a wait."""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.handoff.chunk_codec import encode_chunk
from common.handoff.errors import HandoffError
from common.handoff.parts import TrailerPart
from common.handoff.stream import HandoffAssembler, header_of, split_payload
from common.handoff.tcp_frames import OK, frame_header, hello
from decode_service.chunk_landings import ChunkLandings
from decode_service.reservation import PoolReservation
from decode_service.tcp_feed import TcpFeed
from decode_service.tcp_listener import TcpHandoffListener

SLOT = 1


def _send_frames(port: int, ticket: bytes, bodies) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(hello(None))
        assert sock.recv(1) == OK
        for body in bodies:
            sock.sendall(frame_header(ticket, len(body)) + body)


class RecordingReservation(PoolReservation):
    """Notes, for each write, whether it landed from a pinned host tensor."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pinned_sources: list[bool] = []

    def write(self, field, layer, offset, data) -> None:
        self.pinned_sources.append(isinstance(data, torch.Tensor) and data.is_pinned())
        super().write(field, layer, offset, data)


def _pools(layout, prompt_len: int, device: str):
    kv = layout.field_shape("kv", prompt_len)
    conv = layout.field_shape("conv_state", prompt_len)
    ssm = layout.field_shape("ssm_state", prompt_len)
    dtype = getattr(torch, layout.dtype)
    # pools of 12 pages and 3 slots, laid out as the decode worker's
    return dict(kv=torch.zeros(kv[0], 12, 2, *kv[3:], dtype=dtype, device=device),
                conv=torch.zeros(conv[0], 3, *conv[1:], dtype=dtype, device=device),
                ssm=torch.zeros(ssm[0], 3, *ssm[1:], dtype=getattr(torch, layout.ssm_dtype),
                                device=device))


def land_over_tcp(layout, fingerprint, payload, device: str, chunk_bytes: int,
                  **listener_args):
    """Send ``payload``'s chunks as frames to a listener, land them through a feed into a
    reservation on ``device`` and verify the trailer. Returns (pools, reservation, listener,
    peak buffers out while landing)."""
    pools = _pools(layout, payload.spec.prompt_len, device)
    num_pages = layout.num_pages(payload.spec.prompt_len)
    page_ids = [11, 2, 7, 4, 9][:num_pages]
    freed = []
    reservation = RecordingReservation(header_of(payload), page_ids, SLOT, **pools,
                                       draft_kv=None, free=lambda *room: freed.append(room))
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True,
                                  pin_memory=device == "cuda", **listener_args)
    header, *chunks, trailer = split_payload(payload, chunk_bytes)
    bodies = [encode_chunk(c.field, c.layer, c.offset, c.data) for c in chunks]
    peak = 0

    async def scenario():
        nonlocal peak
        assembler = HandoffAssembler(layout, fingerprint, 1 << 30)
        assembler.check_header(header)
        assembler.start(header, reservation)
        with ThreadPoolExecutor(2) as writer:
            landings = ChunkLandings(assembler, writer)
            feed = TcpFeed(listener.offer(asyncio.get_running_loop()), landings)
            feed.start()
            sending = asyncio.create_task(asyncio.to_thread(
                _send_frames, listener.port, feed.offer.ticket, bodies))
            while not sending.done() or feed.taken < len(bodies):
                peak = max(peak, listener.buffers.num_buffers)
                await asyncio.sleep(0.001)
            await sending
            await feed.wait_for(len(bodies), 10)
            await landings.drain()
            feed.offer.withdraw()
            assembler.on_part(TrailerPart(trailer.checksums, trailer.first_token,
                                          tcp_chunks=len(bodies)))
            assembler.on_end()

    try:
        asyncio.run(scenario())
    finally:
        listener.close()
    return pools, reservation, listener, peak


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("chunk_bytes", [700, 1 << 20])  # pieces of pages; whole layers
def test_frames_land_from_the_pool_and_every_buffer_comes_back(layout, fingerprint,
                                                               make_payload, device,
                                                               chunk_bytes):
    payload = make_payload(prompt_len=37, seed=5)
    pools, reservation, listener, peak = land_over_tcp(layout, fingerprint, payload, device,
                                                       chunk_bytes)
    if device == "cuda":
        reservation.copied.synchronize()  # the copies ran on the reservation's stream
    page_ids = reservation.page_ids
    kv = pools["kv"][:, page_ids].transpose(1, 2).cpu()
    assert torch.equal(kv.view(torch.uint8), payload.fields["kv"].view(torch.uint8))
    for name, pool in (("conv_state", pools["conv"]), ("ssm_state", pools["ssm"])):
        assert torch.equal(pool[:, SLOT].cpu(), payload.fields[name]), name
    assert listener.buffers.pinned == (device == "cuda")
    # every write came from the pool's buffers (pinned ones on a GPU) and gave them back
    assert reservation.pinned_sources and all(p == (device == "cuda")
                                              for p in reservation.pinned_sources)
    assert peak >= 1 and listener.fresh_buffers == 0
    assert listener.buffers.num_buffers == 0 and listener.buffers.bytes_in_use == 0


def test_a_full_pool_or_a_large_frame_gets_a_buffer_of_its_own(layout, fingerprint,
                                                                make_payload):
    payload = make_payload(prompt_len=37, seed=6)
    # room for one 4 KiB piece: the frames beside it, and any frame over 4 KiB, are fresh
    pools, reservation, listener, _ = land_over_tcp(layout, fingerprint, payload, "cpu",
                                                    9000, buffer_bytes=4096)
    kv = pools["kv"][:, reservation.page_ids].transpose(1, 2)
    assert torch.equal(kv, payload.fields["kv"])
    assert torch.equal(pools["ssm"][:, SLOT], payload.fields["ssm_state"])
    assert listener.fresh_buffers > 0
    assert listener.buffers.num_buffers == 0 and listener.buffers.bytes_in_use == 0


def test_pinned_buffers_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA"):
        TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True, pin_memory=True)


def test_a_frame_refused_before_it_lands_gives_its_buffer_back(layout, fingerprint,
                                                               make_payload):
    """A frame that is not one chunk, and every frame after it (dropped): all released."""
    payload = make_payload(prompt_len=9, seed=7)
    header, *chunks, trailer = split_payload(payload, 700)
    listener = TcpHandoffListener("127.0.0.1", 0, accepts=lambda token: True)
    freed = []

    async def scenario():
        assembler = HandoffAssembler(layout, fingerprint, 1 << 30)
        assembler.check_header(header)
        assembler.start(header, RecordingReservation(
            header, [1, 2], SLOT, **_pools(layout, 9, "cpu"), draft_kv=None,
            free=lambda *room: freed.append(room)))
        with ThreadPoolExecutor(2) as writer:
            feed = TcpFeed(listener.offer(asyncio.get_running_loop()),
                           ChunkLandings(assembler, writer))
            feed.start()
            bodies = [b"not a chunk"] + [encode_chunk(c.field, c.layer, c.offset, c.data)
                                         for c in chunks]
            await asyncio.to_thread(_send_frames, listener.port, feed.offer.ticket, bodies)
            with pytest.raises(HandoffError, match="not exactly one chunk"):
                await feed.wait_for(len(bodies), 10)
            feed.offer.withdraw()
            # the reader may still be reading the frames after the refused one, each released
            # as it is dropped or delivered: wait until the sender's closed connection ends,
            # then let the deliveries it posted run
            deadline = time.monotonic() + 10
            while listener.num_connections and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)
        assembler.abort()
        assert freed == [([1, 2], SLOT)]

    try:
        asyncio.run(scenario())
        assert listener.buffers.num_buffers == 0 and listener.buffers.bytes_in_use == 0
    finally:
        listener.close()
