"""MetricsServer: bound at construction, serving a registry once started; the exposition."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from common.metrics.server import MetricsServer, check_metrics_port, exposition
from tests.common.metrics.scrape import Scrape, scrape_url


def registry_with(value: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("flashsplit_test_events", "Events.", registry=registry).inc(value)
    return registry


def test_a_free_port_serves_the_registry_and_closes_on_stop():
    server = MetricsServer("127.0.0.1", 0)
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    server.start(registry_with(3))
    try:
        assert scrape_url(f"http://{server.address}/metrics").value(
            "flashsplit_test_events_total") == 3
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{server.address}/metrics", timeout=2)


def test_a_port_in_use_is_an_error_at_construction():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(metrics\\)"):
            MetricsServer("127.0.0.1", port)


def test_exposition_speaks_prometheus_text_or_openmetrics_as_asked():
    registry = registry_with(2)
    body, content_type = exposition(registry, None)
    assert content_type.startswith("text/plain")
    assert Scrape(body.decode()).value("flashsplit_test_events_total") == 2
    body, content_type = exposition(registry, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.decode().rstrip().endswith("# EOF")


def test_a_metrics_port_beside_tls_is_refused():
    with pytest.raises(ValueError, match="metrics over TLS are not done yet"):
        check_metrics_port(0, "server.pem")
    check_metrics_port(0, None)
    check_metrics_port(None, "server.pem")  # no metrics port: nothing to refuse
