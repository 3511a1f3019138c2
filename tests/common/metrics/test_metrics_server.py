"""MetricsServer: bound at construction, serving a registry once started; the exposition."""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from common.metrics.server import MetricsServer, exposition
from common.metrics.tls import metrics_ssl_context
from tests.common.metrics.scrape import Scrape, scrape_url
from tests.tls_certs import make_pki


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


def _https_get(url: str, ca: str, client=None) -> bytes:
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    with urllib.request.urlopen(url, context=context, timeout=5) as reply:
        return reply.read()


def test_with_the_service_certificate_it_serves_https(tmp_path):
    pki = make_pki(tmp_path)
    server = MetricsServer("127.0.0.1", 0,
                           metrics_ssl_context(pki.server.cert, pki.server.key, None))
    server.start(registry_with(5))
    try:
        assert server.scheme == "https"
        body = _https_get(f"https://{server.address}/metrics", pki.ca)
        assert Scrape(body.decode()).value("flashsplit_test_events_total") == 5
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plaintext beside it
            urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5).read()
        # a failed handshake ends that connection only
        assert _https_get(f"https://{server.address}/metrics", pki.ca) == body
    finally:
        server.stop()


def test_with_a_ca_as_well_a_scraper_must_present_a_certificate_it_signed(tmp_path):
    pki = make_pki(tmp_path)
    server = MetricsServer("127.0.0.1", 0,
                           metrics_ssl_context(pki.server.cert, pki.server.key, pki.ca))
    server.start(registry_with(7))
    url = f"https://{server.address}/metrics"
    try:
        body = _https_get(url, pki.ca, pki.client)
        assert Scrape(body.decode()).value("flashsplit_test_events_total") == 7
        for client in (None, pki.stranger):
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                _https_get(url, pki.ca, client)
    finally:
        server.stop()


def test_tls_flags_that_cannot_work_are_errors_naming_them(tmp_path):
    pki = make_pki(tmp_path)
    assert metrics_ssl_context(None, None, pki.ca) is None  # no identity: plain HTTP
    with pytest.raises(ValueError, match="--tls-cert and --tls-key must be given together"):
        metrics_ssl_context(pki.server.cert, None, None)
    with pytest.raises(ValueError, match="--tls-cert"):
        metrics_ssl_context(pki.server.cert, pki.client.key, None)  # a key of another cert
    with pytest.raises(ValueError, match="--tls-ca"):
        metrics_ssl_context(pki.server.cert, pki.server.key, str(tmp_path / "missing.pem"))
