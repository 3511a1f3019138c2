"""Where a disaggregated request's time goes, read from the workers' Prometheus histograms.

``PhaseScraper`` reads the sums and counts of the prefill worker's queue / prefill / handoff
histograms and the decode worker's handoff histogram before and after a batch of requests; the
mean of each phase over that batch is the difference of sums over the difference of counts.
The phases are those of docs/metrics.md: the prefill worker's queue time (submission to the
first step), prefill time (that step to the first token), and handoff time (first token to the
decode worker's acknowledgement: the part of the handoff that is not hidden behind the prompt's
compute); the decode worker's handoff time is how long room was held before decoding began.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# (column name, metric family name without the _sum/_count suffix)
PHASES = (
    ("prefill_queue_s", "flashsplit_prefill_queue_time_seconds"),
    ("prefill_s", "flashsplit_prefill_prefill_time_seconds"),
    ("prefill_handoff_s", "flashsplit_prefill_handoff_time_seconds"),
    ("decode_handoff_s", "flashsplit_decode_handoff_time_seconds"),
)


def read_histograms(urls: list[str], timeout_s: float = 10.0) -> dict[str, tuple[float, float]]:
    """``{family: (sum, count)}`` over every histogram the endpoints serve, summed over them."""
    totals: dict[str, list[float]] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8")
        for family in text_string_to_metric_families(text):
            if family.type != "histogram":
                continue
            entry = totals.setdefault(family.name, [0.0, 0.0])
            for sample in family.samples:
                if sample.name == family.name + "_sum":
                    entry[0] += sample.value
                elif sample.name == family.name + "_count":
                    entry[1] += sample.value
    return {name: (s, c) for name, (s, c) in totals.items()}


@dataclass
class PhaseScraper:
    """Mean phase times of the requests between :meth:`start` and :meth:`stop`."""

    urls: list[str]

    def start(self) -> None:
        self._before = read_histograms(self.urls)

    def stop(self) -> dict[str, float | None]:
        after = read_histograms(self.urls)
        means: dict[str, float | None] = {}
        for column, name in PHASES:
            s0, c0 = self._before.get(name, (0.0, 0.0))
            s1, c1 = after.get(name, (0.0, 0.0))
            means[column] = (s1 - s0) / (c1 - c0) if c1 > c0 else None
        return means
