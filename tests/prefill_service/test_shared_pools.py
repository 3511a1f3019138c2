"""SharedPools: the engine's pools move into shared memory with their contents, each decode
address gets its handles once, a peer sees what the engine writes, and close leaves nothing."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch

from common.cache.shared_memory import PeerMemory, ShareHandle
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.load import load_model
from prefill_service.shared_pools import SharedPools

SHM = Path("/dev/shm")


def segments() -> set[str]:
    return {p.name for p in SHM.glob("psm_*")} if SHM.is_dir() else set()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture
def engine(model):
    return LLMEngine(model, EngineConfig(cache=CacheConfig(page_size=4, num_pages=8,
                                                           num_slots=3), hold_after_prefill=True))


def test_pools_move_with_their_contents(engine):
    engine.kv_pool.kv.fill_(0.5)
    engine.state_pool.ssm[:, 1].fill_(2.0)
    before = segments()
    shared = SharedPools(engine)
    try:
        assert len(segments() - before) == 3  # kv, conv, ssm; no draft here
        assert engine.kv_pool.kv.eq(0.5).all()
        assert engine.state_pool.ssm[:, 1].eq(2.0).all() and not engine.state_pool.ssm[:, 2].any()
    finally:
        shared.close()
    assert segments() == before


def test_handles_are_made_once_per_address_and_name_each_pool(engine):
    shared = SharedPools(engine)
    try:
        first = shared.handles_for("decode-a:1")
        assert shared.handles_for("decode-a:1") is first
        assert set(msgpack.unpackb(first, raw=False)) == {"kv", "conv", "ssm"}
        assert set(msgpack.unpackb(shared.handles_for("decode-b:1"), raw=False)) == \
            {"kv", "conv", "ssm"}
    finally:
        shared.close()


def test_a_peer_sees_what_the_engine_writes_after_the_move(engine):
    shared = SharedPools(engine)
    peer = PeerMemory()
    try:
        handles = msgpack.unpackb(shared.handles_for("decode:1"), raw=False)
        kv = peer.open_handle(ShareHandle.from_bytes(handles["kv"]))
        conv = peer.open_handle(ShareHandle.from_bytes(handles["conv"]))
        assert kv.shape == engine.kv_pool.kv.shape and kv.dtype == engine.kv_pool.kv.dtype
        engine.kv_pool.kv[0, 3].fill_(7.0)
        engine.state_pool.conv[:, 2].fill_(-1.0)
        assert kv[0, 3].eq(7.0).all() and conv[:, 2].eq(-1.0).all()
        assert torch.equal(kv, engine.kv_pool.kv)
        del kv, conv
    finally:
        peer.close()
        shared.close()
