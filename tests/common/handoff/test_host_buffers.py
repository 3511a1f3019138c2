"""HostBufferPool: bounded, aligned, reusable; waits in order, times out, never hands out
overlapping bytes across threads; refuses caller mistakes."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from common.handoff.host_buffers import (HostBufferExhausted, HostBufferPool,
                                         HostBufferPoolClosed, HostBufferPoolConfig)

KIB = 1024


def pool(capacity=64 * KIB, alignment=4096, pin_memory=None) -> HostBufferPool:
    return HostBufferPool(HostBufferPoolConfig(capacity, alignment, pin_memory))


def test_buffers_are_exact_aligned_views_of_one_allocation():
    p = pool()
    a, b = p.acquire(100), p.acquire(5000)
    assert a.tensor.dtype == torch.uint8 and a.nbytes == 100 and b.nbytes == 5000
    assert a.tensor.data_ptr() % 4096 == 0 and b.tensor.data_ptr() % 4096 == 0
    assert (a.offset, b.offset) == (0, 4096)  # sizes rounded up to the alignment
    assert p.bytes_in_use == 4096 + 8192 and p.num_buffers == 2
    a.numpy()[:] = 7
    assert int(a.tensor.sum()) == 700  # numpy() and tensor are the same bytes
    assert a.tensor.untyped_storage().data_ptr() == b.tensor.untyped_storage().data_ptr()
    a.release()
    b.release()
    assert p.bytes_in_use == 0 and p.num_buffers == 0
    assert p.pinned == torch.cuda.is_available()


def test_reuse_after_release_and_merging_of_free_ranges():
    p = pool(capacity=16 * KIB, alignment=KIB)
    bufs = [p.acquire(KIB) for _ in range(16)]
    assert p.try_acquire(1) is None
    for i in (3, 1, 2, 0, 15, 8, 9, 10, 4, 5, 6, 7, 11, 13, 12, 14):  # out of order
        bufs[i].release()
    whole = p.acquire(16 * KIB)  # the free ranges merged back into one
    assert whole.offset == 0
    whole.release()


def test_try_acquire_never_blocks_and_acquire_times_out():
    p = pool(capacity=8 * KIB)
    held = p.acquire(8 * KIB)
    assert p.try_acquire(1) is None
    start = time.monotonic()
    with pytest.raises(HostBufferExhausted, match="no room for 1 bytes"):
        p.acquire(1, timeout=0.05)
    assert time.monotonic() - start >= 0.05
    with pytest.raises(HostBufferExhausted):
        p.acquire(1, timeout=0)
    held.release()
    with p.acquire(1, timeout=0) as buf:  # a context manager releases
        assert buf.nbytes == 1
    assert p.bytes_in_use == 0


def test_acquire_now_takes_a_free_buffer_else_fresh_memory_and_never_waits():
    p = pool(capacity=8 * KIB, pin_memory=False)
    host, buffer = p.acquire_now(4 * KIB)  # room: a piece of the pool
    assert buffer is not None and host.data_ptr() == buffer.tensor.data_ptr()
    full, none = p.acquire_now(8 * KIB)  # no room now: fresh memory, the pool untouched
    assert none is None and full.numel() == 8 * KIB and full.dtype == torch.uint8
    large, none = p.acquire_now(16 * KIB)  # larger than the pool
    assert none is None and large.numel() == 16 * KIB
    assert p.num_buffers == 1
    buffer.release()
    p.close()
    with pytest.raises(HostBufferPoolClosed):
        p.acquire_now(1)
    fresh, none = p.acquire_now(1, closed_ok=True)
    assert none is None and fresh.numel() == 1


def test_acquire_waits_for_a_release_from_another_thread():
    p = pool(capacity=8 * KIB)
    held = p.acquire(8 * KIB)
    got = []
    waiter = threading.Thread(target=lambda: got.append(p.acquire(4 * KIB, timeout=10)))
    waiter.start()
    time.sleep(0.05)
    assert not got  # still waiting
    held.release()  # the sender's release wakes the engine's acquire
    waiter.join(5)
    assert got and got[0].nbytes == 4 * KIB
    got[0].release()


def test_waiters_are_served_in_arrival_order():
    p = pool(capacity=8 * KIB)
    small = p.acquire(4 * KIB)
    other = p.acquire(4 * KIB)
    order = []

    def want(n, tag):
        buf = p.acquire(n, timeout=10)
        order.append(tag)
        buf.release()

    big = threading.Thread(target=want, args=(8 * KIB, "big"))
    big.start()
    time.sleep(0.05)
    later = threading.Thread(target=want, args=(KIB, "small"))
    later.start()
    time.sleep(0.05)
    small.release()  # 4 KiB free: enough for the small request, which still waits its turn
    time.sleep(0.05)
    assert order == []
    assert p.try_acquire(1) is None  # nor does try_acquire jump the queue
    other.release()
    big.join(5)
    later.join(5)
    assert order == ["big", "small"]


def test_close_wakes_waiters_and_refuses_new_acquires():
    p = pool(capacity=4 * KIB)
    held = p.acquire(4 * KIB)
    errors = []

    def wait():
        try:
            p.acquire(KIB)
        except HostBufferPoolClosed as err:
            errors.append(err)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    p.close()
    t.join(5)
    assert len(errors) == 1
    with pytest.raises(HostBufferPoolClosed):
        p.acquire(1)
    with pytest.raises(HostBufferPoolClosed):
        p.try_acquire(1)
    held.tensor.fill_(1)  # still valid memory after close
    held.release()        # and releasable


def test_caller_mistakes():
    p, q = pool(), pool()
    with pytest.raises(ValueError, match="never fit"):
        p.acquire(64 * KIB + 1)
    with pytest.raises(ValueError, match=">= 1"):
        p.acquire(0)
    with pytest.raises(TypeError):
        p.acquire(1.5)
    with pytest.raises(ValueError, match="timeout"):
        p.acquire(1, timeout=-1)
    buf = p.acquire(np.int64(10))
    with pytest.raises(ValueError, match="not outstanding"):
        q.release(buf)
    buf.release()
    with pytest.raises(ValueError, match="not outstanding"):
        buf.release()
    with pytest.raises(ValueError, match="power of two"):
        HostBufferPoolConfig(1024, alignment=3)
    with pytest.raises(ValueError, match="capacity"):
        HostBufferPoolConfig(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinning_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        pool(pin_memory=True)
    assert not pool(pin_memory=False).pinned


def test_threads_never_share_bytes():
    """Engine threads acquire and fill, sender threads check and release: every buffer's bytes
    are its own while it is out, and the pool ends empty."""
    p = pool(capacity=256 * KIB, alignment=512)
    handed = []
    cond = threading.Condition()
    failures = []
    per_producer = 300

    def engine(seed):
        rng = random.Random(seed)
        for i in range(per_producer):
            buf = p.acquire(rng.randrange(1, 40 * KIB), timeout=30)
            tag = (seed * per_producer + i) % 251 + 1
            buf.tensor.fill_(tag)
            with cond:
                handed.append((buf, tag))
                cond.notify()

    def sender(count):
        for _ in range(count):
            with cond:
                while not handed:
                    cond.wait()
                buf, tag = handed.pop(random.randrange(len(handed)))
            time.sleep(0.0001)
            if not bool((buf.tensor == tag).all()):
                failures.append(buf)
            buf.release()

    engines = [threading.Thread(target=engine, args=(s,)) for s in range(3)]
    senders = [threading.Thread(target=sender, args=(per_producer * 3 // 2,)) for _ in range(2)]
    for t in engines + senders:
        t.start()
    for t in engines + senders:
        t.join(60)
    assert not any(t.is_alive() for t in engines + senders)
    assert not failures
    assert p.bytes_in_use == 0 and p.num_buffers == 0
    assert p.acquire(256 * KIB, timeout=0).offset == 0  # fully merged again


@pytest.mark.gpu
def test_pinned_buffers_take_async_device_copies():
    p = pool(capacity=1 << 20)
    assert p.pinned
    src = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
    buf = p.acquire(src.numel() * 4)
    assert buf.tensor.is_pinned()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        buf.tensor.view(torch.int32).copy_(src, non_blocking=True)
    stream.synchronize()
    assert torch.equal(buf.tensor.view(torch.int32), src.cpu())
    buf.release()
