"""common/limits.py and its use in common/convert.py: stop ids and request ids, on every side."""

from __future__ import annotations

import pytest

from common import convert
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.handoff.errors import HandoffError
from common.limits import (MAX_STOP_TOKEN_IDS, check_request_id, request_capacity_tokens,
                           unique_stop_token_ids)
from common.model.dflash import load_draft
from common.model.load import load_model
from common.pb.flashsplit.v1 import decode_pb2, types_pb2


def test_stop_ids_are_deduplicated_in_order_and_capped():
    assert unique_stop_token_ids([5, 3, 5, 5, 3, 9]) == (5, 3, 9)
    assert len(unique_stop_token_ids(list(range(MAX_STOP_TOKEN_IDS)) * 3)) == MAX_STOP_TOKEN_IDS
    with pytest.raises(ValueError, match="at most 1024 distinct stop_token_ids are accepted, "
                                         "got 1025"):
        unique_stop_token_ids(range(MAX_STOP_TOKEN_IDS + 1))


def test_sampling_from_the_wire_deduplicates_and_caps_stop_ids():
    msg = types_pb2.SamplingParams(stop_token_ids=[7, 7, 2, 7])
    assert convert.sampling_from_pb(msg).stop_token_ids == (7, 2)
    with pytest.raises(ValueError, match="at most 1024"):
        convert.sampling_from_pb(types_pb2.SamplingParams(stop_token_ids=range(2000)))


def test_request_ids_are_capped_in_utf8_bytes():
    check_request_id("")
    check_request_id("x" * 256)
    check_request_id("é" * 128)
    with pytest.raises(ValueError, match="at most 256 bytes, got 258"):
        check_request_id("é" * 129)


def test_a_handoff_header_with_a_long_request_id_is_invalid_argument():
    header = decode_pb2.HandoffHeader(handoff_id=1, prompt_len=1, prompt_token_ids=[1],
                                      request_id="h" * 300)
    header.layout.SetInParent()
    header.sampling.SetInParent()
    with pytest.raises(HandoffError) as err:
        convert.handoff_part_from_pb(decode_pb2.HandoffMessage(header=header))
    assert err.value.code == "INVALID_ARGUMENT" and "at most 256 bytes" in err.value.message


@pytest.mark.parametrize("reserve_output, draft", [(False, False), (True, False), (True, True)],
                         ids=["prefill", "decode", "decode-with-draft"])
def test_capacity_is_what_a_request_can_take_with_every_page_free(reserve_output, draft):
    model = load_model("tiny")
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=10, num_slots=3),
                          scheduler=SchedulerConfig(reserve_output_tokens=reserve_output))
    engine = LLMEngine(model, config, draft=load_draft("tiny", model) if draft else None)
    block = engine.speculator.block_size if draft else 0
    # 9 usable pages (page 0 is scratch); a decode engine with a draft keeps room for a block
    assert request_capacity_tokens(engine) == 9 * 4 - block
    if reserve_output:  # the scheduler agrees: exactly this many fit, one more does not
        capacity = request_capacity_tokens(engine)
        engine.cache.pages_for(capacity - 1, 1)
        with pytest.raises(ValueError):
            engine.cache.pages_for(capacity, 1)
