"""common/request_spec.py: what one request is, as every stage holds it."""

from __future__ import annotations

import dataclasses

import pytest

from common.request_spec import RequestSpec
from common.sampling import SamplingParams


def test_prompt_ids_become_a_tuple_and_set_the_length():
    spec = RequestSpec("r", [3, 4, 5], SamplingParams())
    assert spec.prompt_ids == (3, 4, 5) and spec.prompt_len == 3
    assert hash(spec) == hash(RequestSpec("r", (3, 4, 5), SamplingParams()))


def test_the_speculative_choice_travels_in_the_sampling():
    spec = RequestSpec("r", (1,), SamplingParams(speculative=False))
    assert spec.sampling.speculative is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.request_id = "other"
