"""A prefill rank's band sender reports what it could not send: a decode rank that is not
there makes its handoff's report an error (the handoff then fails), and a dropped handoff
sends nothing more."""

from __future__ import annotations

import threading

import torch

from common.model.registry import load_config
from common.parallel.rank_streams import RankStreamPlan
from prefill_service.band_sender import BandSender
from tests.ports import closed_port


def sender():
    c = load_config("tiny")
    kv = torch.zeros(2, 8, 2, 4, c.num_key_value_heads, c.head_dim, dtype=torch.bfloat16)
    conv = torch.zeros(3, 4, c.conv_dim, 3, dtype=torch.bfloat16)
    ssm = torch.zeros(3, 4, c.linear_num_value_heads, c.linear_value_head_dim,
                      c.linear_key_head_dim)
    return BandSender(c, 0, kv, conv, ssm)


def test_an_unreachable_decode_rank_is_reported():
    s = sender()
    plan = RankStreamPlan("127.0.0.1", (closed_port(),), b"t" * 16, None, 6, 4, 1)
    s.send(1, plan, [1, 2], 0, 1)
    report = s.finish(1).result(timeout=30)
    assert report.error is not None and "unreachable" in report.error
    s.close()


def test_a_dropped_handoff_sends_nothing_more():
    s = sender()
    plan = RankStreamPlan("127.0.0.1", (closed_port(),), b"t" * 16, None, 6, 4, 1)
    step_over = threading.Event()
    s.send(2, plan, [1, 2], 0, None, wait=step_over.wait)  # still waiting for its step
    s.send(2, plan, [], 2, 1)
    s.drop(2)
    step_over.set()
    report = s.finish(2).result(timeout=30)
    # had it tried to connect, the report would say the decode rank is unreachable
    assert report.frames == () and "dropped" in report.error
    s.close()
