"""Hidden-state capture for draft training equals what the engine's prefill hands the draft."""

from __future__ import annotations

import pytest
import torch

from common.engine.llm_engine import CacheConfig, make_pools
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.load import load_model
from common.training.capture import HiddenCapture


@pytest.fixture(scope="module")
def target():
    return load_model("tiny")


def prefill_aux(target, ids):
    """The aux hidden states of one prompt's EXTEND, as a speculating engine runs it."""
    kv_pool, state_pool = make_pools(target, CacheConfig(page_size=4, num_pages=32,
                                                         num_slots=4), "cpu")
    pages = kv_pool.allocator.allocate(kv_pool.pages_for(len(ids)))
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=[ids], prefix_lens=[0],
                               page_ids=[pages], page_size=4, state_slots=[state_pool.allocate()])
    return target(batch, kv_pool=kv_pool, state_pool=state_pool).aux_hidden_states


def test_capture_equals_prefill_and_starts_fresh(target):
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    capture = HiddenCapture(target, [0, 3, 1], max_sequences=3, seq_len=24, device="cpu")
    assert target.capture_layer_ids == (0, 3, 1)
    aux = capture(tokens)
    assert aux.shape == (3, 20, 3 * target.config.hidden_size) and not aux.is_inference()
    for s in range(3):
        assert torch.allclose(aux[s], prefill_aux(target, tokens[s].tolist()), atol=1e-5)
    # a second call starts from empty caches again (pages and slots are given back)
    assert torch.equal(capture(tokens), aux)
    assert torch.allclose(capture(tokens[1:, :7]), aux[1:, :7], atol=1e-5)
    with pytest.raises(ValueError, match="at most 3 x 24"):
        capture(torch.zeros(4, 8, dtype=torch.long))
