"""EngineConfig: what it refuses."""

from __future__ import annotations

import pytest

from common.engine.engine_config import EngineConfig


@pytest.mark.parametrize("limit", [0, -3])
def test_the_speculation_batch_limit_must_be_positive(limit):
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(speculative_disable_by_batch_size=limit)


def test_no_speculation_limit_by_default():
    assert EngineConfig().speculative_disable_by_batch_size is None
    assert EngineConfig(speculative_disable_by_batch_size=1).speculative_disable_by_batch_size == 1
