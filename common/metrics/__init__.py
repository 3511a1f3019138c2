"""Prometheus metrics: one typed object per service, each with a registry of its own
(``docs/metrics.md``)."""
