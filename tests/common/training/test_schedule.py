"""Training budgets and the learning-rate schedule over them."""

from __future__ import annotations

import pytest

from common.training.schedule import Budget, Clock, CosineSchedule


def test_budget_ends_at_whichever_limit_comes_first():
    steps = Budget(max_steps=10)
    assert steps.fraction(5, 1e9) == 0.5 and not steps.done(9, 0) and steps.done(10, 0)
    seconds = Budget(max_seconds=4.0)
    assert seconds.fraction(10**6, 1.0) == 0.25 and seconds.done(0, 4.0)
    both = Budget(max_steps=100, max_seconds=10.0)
    assert both.fraction(50, 2.0) == 0.5 and both.fraction(10, 8.0) == 0.8
    assert both.fraction(1000, 0) == 1.0


@pytest.mark.parametrize("kwargs", [{}, {"max_steps": 0}, {"max_seconds": 0.0}])
def test_budget_is_checked(kwargs):
    with pytest.raises(ValueError):
        Budget(**kwargs)


def test_cosine_schedule():
    s = CosineSchedule(peak_lr=1.0, warmup=0.1, min_ratio=0.1)
    assert s.lr(0.05) == pytest.approx(0.5)
    assert s.lr(0.1) == pytest.approx(1.0)
    assert s.lr(0.55) == pytest.approx(0.55)  # halfway down the cosine
    assert s.lr(1.0) == pytest.approx(0.1)
    assert 0 < s.lr(0.0) < s.lr(0.01)
    lrs = [s.lr(f / 100) for f in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_clock_counts_resumed_seconds():
    assert Clock(already_s=30.0).elapsed() >= 30.0
