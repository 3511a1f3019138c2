"""PoolReservation: a write never lands in room given back, and giving back waits for a write
that is running."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from common.handoff.errors import HandoffError
from common.handoff.stream import header_of
from decode_service.reservation import PoolReservation


def reservation(payload, freed, write_started=None, write_may_end=None):
    layout = payload.layout
    kv = torch.zeros(len(layout.full_attention_layers), 8, 2, layout.page_size,
                     layout.kv_heads, layout.head_dim, dtype=torch.bfloat16)
    res = PoolReservation(header_of(payload), [3, 5, 6], 1, kv=kv,
                          conv=torch.zeros(2, 4, 8), ssm=torch.zeros(2, 4, 8), draft_kv=None,
                          free=lambda pages, slot: freed.append((pages, slot)))
    if write_started is not None:
        def slow_write(field, layer, offset, data):
            write_started.set()
            write_may_end.wait(5)
        res._write = slow_write
    return res


def test_release_waits_for_a_running_write_and_refuses_later_ones(make_payload):
    payload = make_payload(prompt_len=40)
    freed, started, may_end = [], threading.Event(), threading.Event()
    res = reservation(payload, freed, started, may_end)
    writer = threading.Thread(target=res.write, args=("kv", 0, 0, b"\0" * 16))
    writer.start()
    assert started.wait(5)
    releaser = threading.Thread(target=res.release)
    releaser.start()
    time.sleep(0.05)
    assert freed == [] and releaser.is_alive()  # the write is still running
    may_end.set()
    releaser.join(5)
    writer.join(5)
    assert freed == [([3, 5, 6], 1)]
    with pytest.raises(HandoffError) as late:
        res.write("kv", 0, 0, b"\0" * 16)
    assert late.value.code == "ABORTED"
    res.release()  # idempotent
    assert len(freed) == 1
