"""Reading values back out of prometheus_client metrics (for ``GetLoad`` and tests), through
the public ``collect()``, as a scrape does."""

from __future__ import annotations

from collections.abc import Mapping


def sample_sum(metric, sample_name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of ``metric``'s samples named ``sample_name`` (e.g. ``..._total``, ``..._sum``)
    whose labels include ``labels``: a labelled counter's total over the label values left
    open."""
    want = dict(labels or {})
    return sum(s.value for family in metric.collect() for s in family.samples
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in want.items()))


def sample_total(metric, sample_name: str, labels: Mapping[str, str] | None = None) -> int:
    """:func:`sample_sum` as a whole number (counters of events, tokens and bytes)."""
    return int(round(sample_sum(metric, sample_name, labels)))


def sums_by_label(metric, sample_name: str, label: str) -> dict[str, float]:
    """``metric``'s samples named ``sample_name``, summed per value of ``label``."""
    sums: dict[str, float] = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name == sample_name:
                sums[s.labels[label]] = sums.get(s.labels[label], 0.0) + s.value
    return sums
