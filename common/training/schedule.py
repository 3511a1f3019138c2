"""How long a training run lasts (steps, wall-clock seconds, or whichever ends first), the
learning rate along it, and its progress bar.

The learning-rate schedule runs on the fraction of the budget used, not on the step number, so
a run given only a time budget still warms up and decays over exactly that time.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """A run ends at ``max_steps`` optimizer steps or ``max_seconds`` of training, whichever
    comes first (at least one must be given)."""

    max_steps: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError("a training budget needs a number of steps or of seconds")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {self.max_steps}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds}")

    def fraction(self, step: int, elapsed_s: float) -> float:
        """The share of the budget used, 0..1."""
        parts = []
        if self.max_steps is not None:
            parts.append(step / self.max_steps)
        if self.max_seconds is not None:
            parts.append(elapsed_s / self.max_seconds)
        return min(1.0, max(parts))

    def done(self, step: int, elapsed_s: float) -> bool:
        return self.fraction(step, elapsed_s) >= 1.0


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warm-up to ``peak_lr`` over ``warmup`` of the budget, then a cosine down to
    ``min_ratio * peak_lr`` at its end."""

    peak_lr: float
    warmup: float = 0.03
    min_ratio: float = 0.1

    def lr(self, fraction: float) -> float:
        if self.warmup > 0 and fraction < self.warmup:
            return self.peak_lr * max(fraction, 1e-3) / self.warmup
        span = max(1e-9, 1.0 - self.warmup)
        t = min(1.0, (fraction - self.warmup) / span)
        low = self.min_ratio * self.peak_lr
        return low + (self.peak_lr - low) * 0.5 * (1.0 + math.cos(math.pi * t))


class Clock:
    """Seconds of training so far, counting those of the runs this one resumes."""

    def __init__(self, already_s: float = 0.0) -> None:
        self._start = time.monotonic() - already_s

    def elapsed(self) -> float:
        return time.monotonic() - self._start


class BudgetBar:
    """A tqdm bar in percent of the budget, with the latest figures after it."""

    def __init__(self, desc: str, *, enabled: bool = True, initial: float = 0.0) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=100.0, initial=round(100 * initial, 1), desc=desc, unit="%",
                         file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                         bar_format="{l_bar}{bar}| {n:.0f}/100% [{elapsed}<{remaining}"
                                    "{postfix}]")
        self._shown = round(100 * initial, 1)

    def update(self, fraction: float, **figures) -> None:
        target = round(100 * fraction, 1)
        if target > self._shown:
            self._bar.update(target - self._shown)
            self._shown = target
        self._bar.set_postfix(figures, refresh=False)

    def close(self) -> None:
        self._bar.close()
