"""common/logprobs.py (the checks on what a request asks for) and common/engine/step_logprobs.py
(the log-probabilities of a step's rows)."""

from __future__ import annotations

import pytest
import torch

from common.engine.step_logprobs import StepLogprobs, logprobs_per_row
from common.logprobs import MAX_LOGPROBS, TokenLogprobs, check_asked, check_num_logprobs
from common.sampling import SamplingParams


def test_rows_that_ask_get_log_softmax_of_their_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    tokens = torch.tensor([7, 1, 49, 3])
    step = StepLogprobs.of(logits, tokens, [2, None, 0, 5])
    rows = step.per_row(4)
    assert rows[1] is None
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, k in ((0, 2), (2, 0), (3, 5)):
        assert rows[i].logprob == pytest.approx(reference[i, tokens[i]].item(), abs=1e-5)
        want = reference[i].topk(k)
        assert [t for t, _ in rows[i].top] == want.indices.tolist()
        assert [v for _, v in rows[i].top] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert step.to_host().per_row(4) == rows


def test_no_row_asks_and_bad_arguments():
    logits, tokens = torch.zeros(2, 8), torch.zeros(2, dtype=torch.long)
    assert StepLogprobs.of(logits, tokens, [None, None]) is None
    assert logprobs_per_row(logits, tokens, [None, None]) == [None, None]
    with pytest.raises(ValueError, match="N counts"):
        StepLogprobs.of(logits, tokens, [1])
    with pytest.raises(ValueError, match="logprobs"):
        StepLogprobs.of(logits, tokens, [MAX_LOGPROBS + 1, None])


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_limits_of_what_a_request_may_ask(value):
    with pytest.raises(ValueError, match="logprobs"):
        check_num_logprobs(value)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)
    for ok in (None, 0, MAX_LOGPROBS):
        check_num_logprobs(ok)


def test_logprobs_made_elsewhere_are_what_the_request_asks():
    check_asked(None, None)
    check_asked(TokenLogprobs(-1.0, ((1, -1.0),)), 1)
    for logprobs, num_top in ((None, 0), (TokenLogprobs(-1.0), None),
                              (TokenLogprobs(-1.0, ((1, -1.0),)), 2)):
        with pytest.raises(ValueError, match="log-probabilities"):
            check_asked(logprobs, num_top)
