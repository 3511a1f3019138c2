"""PayloadRelay: buffers created per field on first appearance, never frozen by the first payload."""

from __future__ import annotations

import pytest
import torch

from common.engine.relay import PayloadRelay, RelayError


def test_field_absent_from_first_payload_still_relays():
    # NOTE: the regression this guards (reference/disagg.md §2.4): a first payload without top_k
    # froze the layout and every later top_k was silently dropped.
    relay = PayloadRelay(max_slots=8)
    relay.write_all([1, 2], {"next_token_ids": torch.tensor([5, 6]), "top_k": None})
    assert relay.has("next_token_ids") and not relay.has("top_k")
    top_k = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.4, 0.3, 0.2, 0.1]])
    relay.write_all([3, 1], {"next_token_ids": torch.tensor([7, 8]), "top_k": top_k})
    assert torch.equal(relay.read("top_k", [3, 1], require_written=True), top_k)
    assert torch.equal(relay.read("next_token_ids", [1, 2, 3]), torch.tensor([8, 6, 7]))
    assert relay.spec("top_k") == ((4,), torch.float32)


def test_read_of_never_written_field():
    relay = PayloadRelay(max_slots=4)
    relay.write("next_token_ids", [0], torch.tensor([1]))
    with pytest.raises(RelayError, match="top_k"):
        relay.read("top_k", [0])


def test_write_must_match_buffer_shape_and_dtype():
    relay = PayloadRelay(max_slots=4)
    relay.write("top_k", [0], torch.zeros(1, 4))
    with pytest.raises(RelayError):
        relay.write("top_k", [1], torch.zeros(1, 5))
    with pytest.raises(RelayError):
        relay.write("top_k", [1], torch.zeros(1, 4, dtype=torch.float16))
    with pytest.raises(RelayError):
        relay.write("top_k", [1, 2], torch.zeros(1, 4))  # one row for two slots


def test_slot_range_checked():
    relay = PayloadRelay(max_slots=4)
    with pytest.raises(RelayError):
        relay.write("x", [4], torch.zeros(1))
    relay.write("x", torch.tensor([3]), torch.ones(1))
    with pytest.raises(RelayError):
        relay.read("x", torch.tensor([-1]))


def test_clear_zeroes_and_invalidates_rows():
    relay = PayloadRelay(max_slots=4)
    relay.write("x", [1, 2], torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    relay.clear([1])
    assert torch.equal(relay.read("x", [1, 2]), torch.tensor([[0, 0], [3, 4]], dtype=torch.int32))
    relay.read("x", [2], require_written=True)
    with pytest.raises(RelayError, match=r"\[1\]"):
        relay.read("x", [1, 2], require_written=True)
