"""Fixtures of the tests of the followers' per-rank streams on both sides: a real TCPStore
(the group's), the tiny model's config, and the handoff listeners a test opens (closed after)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


@pytest.fixture
def config():
    from common.model.registry import load_config

    return load_config("tiny")


@pytest.fixture
def listeners():
    made = []
    yield made
    for listener in made:
        listener.close()
