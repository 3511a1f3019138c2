"""Prometheus text as a test reads it: parsed with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape's samples; ``value(name, **labels)`` sums the samples called ``name`` whose
    labels include ``labels`` (0 when there is none), ``types`` maps family names to types."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.types = {f.name: f.type for f in self.families}
        self.samples = [s for f in self.families for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)

    def label_values(self, name: str, label: str) -> set[str]:
        return {s.labels[label] for s in self.samples if s.name == name and label in s.labels}


def scrape_registry(registry) -> Scrape:
    return Scrape(generate_latest(registry).decode())


def scrape_url(url: str, timeout_s: float = 5.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return Scrape(resp.read().decode())
