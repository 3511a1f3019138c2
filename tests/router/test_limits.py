"""router/limits.py: the router's caps and what the workers can ever hold."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.load_report import LoadReport
from common.sampling import SamplingParams
from router.limits import RequestLimits, WorkerCapacity, check_request_size, check_text_size


@dataclass
class Row:
    kind: str
    healthy: bool
    load: LoadReport | None


def report(kind: str, tokens: int) -> LoadReport:
    return LoadReport(kind=kind, max_request_tokens=tokens)


def test_capacity_is_the_largest_healthy_worker_of_each_kind():
    rows = [Row("prefill", True, report("prefill", 100)), Row("prefill", True,
                                                               report("prefill", 300)),
            Row("prefill", False, report("prefill", 9000)),  # down: does not count
            Row("decode", True, report("decode", 50)), Row("decode", True, None)]
    assert WorkerCapacity.of(rows) == WorkerCapacity(prompt_tokens=300, request_tokens=50)
    # workers that report nothing (0) leave the check to them
    assert WorkerCapacity.of([Row("decode", True, report("decode", 0))]) == WorkerCapacity()


@pytest.mark.parametrize("ids, new, limits, capacity, match", [
    ([1] * 11, 1, RequestLimits(max_prompt_tokens=10), WorkerCapacity(), "--max-prompt-tokens"),
    ([1] * 11, 1, RequestLimits(), WorkerCapacity(prompt_tokens=10),
     "the largest prefill worker holds 10"),
    ([1] * 5, 6, RequestLimits(), WorkerCapacity(request_tokens=10),
     r"plus max_new_tokens \(6\) needs 11 token positions; the largest decode worker holds 10"),
])
def test_requests_too_large_are_refused(ids, new, limits, capacity, match):
    with pytest.raises(ValueError, match=match):
        check_request_size(ids, SamplingParams(max_new_tokens=new), limits, capacity)


def test_requests_at_the_limits_pass():
    check_request_size([1] * 10, SamplingParams(max_new_tokens=5), RequestLimits(
        max_prompt_tokens=10), WorkerCapacity(prompt_tokens=10, request_tokens=15))
    # nothing known: only the router's own cap applies
    check_request_size([1] * 100_000, SamplingParams(max_new_tokens=5), RequestLimits(),
                       WorkerCapacity())


def test_text_size_counts_utf8_bytes():
    limits = RequestLimits(max_prompt_bytes=8, max_message_bytes=64)
    check_text_size("ab" * 4, limits)
    check_text_size("é" * 4, limits)  # 8 bytes
    with pytest.raises(ValueError, match="the prompt text has 9 bytes; at most 8"):
        check_text_size("é" * 4 + "x", limits)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_prompt_tokens=-1), "--max-prompt-tokens"),
    (dict(max_prompt_bytes=0), "--max-prompt-bytes"),
    (dict(max_prompt_bytes=10, max_message_bytes=5), "--max-message-bytes"),
])
def test_limit_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RequestLimits(**kwargs)
