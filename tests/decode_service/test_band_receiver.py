"""Per-rank streams in one process over real TCP on 127.0.0.1: each prefill rank's band sender
sends its heads of a request from its pools to the decode ranks' receivers, which land them
in theirs at other pages and another slot; every decode rank ends with exactly its part of the
full state, and the bands' checksums agree. A frame of a band the rank does not hold, bytes
sent twice, or bytes that never come are refused with the status docs/protocol.md gives."""

from __future__ import annotations

import secrets

import pytest
import torch

from common.handoff.chunk_codec import encode_chunk
from common.model.registry import load_config
from common.parallel.rank_streams import RankStreamPlan, held_ranges
from decode_service.band_receiver import BandReceiver
from decode_service.tcp_listener import TcpHandoffListener
from prefill_service.band_sender import BandSender
from prefill_service.leader_bands import merge_sent
from prefill_service.tcp_connections import TcpConnections
from tests.common.parallel.band_fixtures import listeners  # noqa: F401

PAGE, PROMPT, LAYERS, GDN_LAYERS, W = 4, 10, 2, 3, 3  # 3 pages, the last one half full
SPLIT = {"kv": 4, "conv": 2, "ssm": 2}


@pytest.fixture(scope="module")
def config():
    return load_config("tiny")


def full_pools(config, pages=8, slots=4):
    g = torch.Generator().manual_seed(0)
    c = config
    return {"kv": torch.randn(LAYERS, pages, 2, PAGE, c.num_key_value_heads, c.head_dim,
                              generator=g).to(torch.bfloat16),
            "conv": torch.randn(GDN_LAYERS, slots, c.conv_dim, W, generator=g).to(torch.bfloat16),
            "ssm": torch.randn(GDN_LAYERS, slots, c.linear_num_value_heads,
                               c.linear_value_head_dim, c.linear_key_head_dim, generator=g)}


def part(config, full, rank, world):
    held = held_ranges(config, rank, world)
    out = {}
    for pool, name in (("kv", "kv"), ("conv", "conv_state"), ("ssm", "ssm_state")):
        out[pool] = torch.cat([full[pool].narrow(SPLIT[pool], a, b - a)
                               for a, b in held[name]], dim=SPLIT[pool]).contiguous()
    return out


def receivers(config, world, listeners):
    full = {k: torch.zeros_like(v) for k, v in full_pools(config).items()}
    out = []
    for rank in range(world):
        pools = part(config, full, rank, world)
        listener = TcpHandoffListener("127.0.0.1", 0, lambda token: True)
        listeners.append(listener)
        out.append((BandReceiver(listener, config, rank, world, pools["kv"], pools["conv"],
                                 pools["ssm"]), pools))
    return out


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (2, 4)])
def test_every_decode_rank_lands_its_part(config, listeners, src_tp, dst_tp):
    full = full_pools(config)
    src_pages, src_slot, dst_pages, dst_slot = [3, 5, 7], 1, [2, 4, 6], 2
    decode = receivers(config, dst_tp, listeners)
    ticket = secrets.token_bytes(16)
    plan = RankStreamPlan("127.0.0.1", tuple(r.port for r, _ in decode), ticket, None, PROMPT,
                          PAGE, src_tp)
    for receiver, _ in decode:
        receiver.expect(ticket, dst_pages, dst_slot, PROMPT, PAGE, src_tp)
    senders = []
    for rank in range(src_tp):
        pools = part(config, full, rank, src_tp)
        sender = BandSender(config, rank, pools["kv"], pools["conv"], pools["ssm"])
        senders.append(sender)
        sender.send(7, plan, src_pages[:2], 0, None)  # a chunk's pages, then the rest
        sender.send(7, plan, src_pages[2:], 2, src_slot)
    sent = merge_sent([s.finish(7).result(timeout=30) for s in senders])
    assert sent.error is None
    for rank, (receiver, pools) in enumerate(decode):
        landed = receiver.complete(ticket, sent.frames[rank], 10.0)
        assert landed.code is None, landed.message
        assert landed.checksums == {k: sent.checksums[k] for k in landed.checksums}
        want = part(config, full, rank, dst_tp)
        got_kv, want_kv = pools["kv"][:, dst_pages], want["kv"][:, src_pages].clone()
        want_kv[:, -1, :, PROMPT % PAGE:] = 0  # the last page's tail is sent as zeros
        assert torch.equal(got_kv, want_kv)
        assert torch.equal(pools["conv"][:, dst_slot], want["conv"][:, src_slot])
        assert torch.equal(pools["ssm"][:, dst_slot], want["ssm"][:, src_slot])
    for sender in senders:
        sender.close()


def frames_to(receiver, ticket, *messages):
    connection = TcpConnections(None).acquire("127.0.0.1", receiver.port)
    for message in messages:
        connection.submit(ticket, message)
    connection.flush()
    connection.close()


@pytest.mark.parametrize("case,code", [("not held", "INVALID_ARGUMENT"),
                                       ("twice", "INVALID_ARGUMENT"),
                                       ("missing", "DATA_LOSS"),
                                       ("too few", "DEADLINE_EXCEEDED")])
def test_refusals_are_precise(config, listeners, case, code):
    (receiver, _), _ = receivers(config, 2, listeners)
    ticket = secrets.token_bytes(16)
    receiver.expect(ticket, [1, 2, 3], 1, PROMPT, PAGE, 2)  # rank 0 of 2 holds KV head 0
    ssm_layer = bytes(2 * config.linear_value_head_dim * config.linear_key_head_dim * 4)
    good = encode_chunk("ssm_state[0:2]", 0, 0, ssm_layer)
    messages = {"not held": [encode_chunk("kv[1:2]", 0, 0, b"\0" * 64)],
                "twice": [good, good],
                "missing": [good],
                "too few": [good]}[case]
    frames_to(receiver, ticket, *messages)
    expected = len(messages) + (1 if case == "too few" else 0)
    landed = receiver.complete(ticket, expected, 1.0)
    assert landed.code == code, landed.message
