import pytest

from common.sampling import SamplingParams
from common.tokenizer import ByteTokenizer
from router.requests import OutputTracker, ServedModel, check_prompt, with_seed

MODEL = ServedModel("tiny", "qwen3_5_text", vocab_size=260, max_context_len=64,
                    eos_token_ids=(256,), dtype="float32")


def test_timings_are_measured_from_arrival():
    t = OutputTracker(ByteTokenizer(), prompt_ids=[104, 105], arrival=10.0)
    d1 = t.add([72], 10.5, [1])
    d2 = t.add([105, 33, 33], 10.75, [3])
    last = t.add([10], 11.0, [1], finish_reason="stop", prefill_times=(0.1, 0.2, 0.3))
    assert (d1.text, d2.text, last.text) == ("H", "i!!", "\n")
    assert d1.timings is None and d2.finish_reason is None
    tm = last.timings
    assert tm.time_to_first_token_s == 0.5 and tm.total_s == 1.0
    assert tm.inter_token_latencies_s == (0.25, 0.0, 0.0, 0.25)
    assert (tm.prefill_queue_s, tm.prefill_s, tm.handoff_s) == (0.1, 0.2, 0.3)
    assert (last.prompt_tokens, last.completion_tokens) == (2, 5)
    assert t.text == "Hi!!\n" and t.accept_lengths == [1, 3, 1]


def test_split_utf8_is_held_back_then_flushed():
    t = OutputTracker(ByteTokenizer(), prompt_ids=[1], arrival=0.0)
    e = "é".encode()
    assert t.add([e[0]], 1.0).text == ""
    assert t.add([e[1]], 2.0).text == "é"
    assert t.add([e[0]], 3.0, finish_reason="length").text == "\ufffd"


def test_finish_without_new_tokens():
    t = OutputTracker(ByteTokenizer(), prompt_ids=[1], arrival=0.0)
    t.add([65], 1.0)
    last = t.add([], 2.0, finish_reason="stop")
    assert last.timings.total_s == 1.0 and last.timings.inter_token_latencies_s == ()


def test_with_seed_draws_only_when_unset():
    assert isinstance(with_seed(SamplingParams()).seed, int)
    assert with_seed(SamplingParams(seed=7, temperature=0.0)).seed == 7


@pytest.mark.parametrize("ids,params,match", [
    ([], SamplingParams(), "empty"),
    ([1, 260], SamplingParams(), "outside the vocabulary"),
    ([1], SamplingParams(stop_token_ids=(300,)), "stop token"),
    ([1] * 60, SamplingParams(max_new_tokens=5), "context length"),
])
def test_check_prompt_rejects(ids, params, match):
    with pytest.raises(ValueError, match=match):
        check_prompt(ids, params, MODEL)


def test_check_prompt_accepts_the_edge():
    check_prompt([259] * 59, SamplingParams(max_new_tokens=5), MODEL)
