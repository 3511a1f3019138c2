"""The HTTP exposition of a service's metrics: ``--metrics-port`` (a thread of its own) and
the body for a route on an existing HTTP server (the router's HTTP API)."""

from __future__ import annotations

import argparse
import socket
import ssl
import threading
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder


def add_metrics_port_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics, HOST being "
                        "--host (0 = any free port, printed as '... metrics on HOST:PORT'; "
                        "https with this service's --tls-cert, and client certificates "
                        "required with --tls-ca; default: not served)")


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """``registry``'s samples as the body of an HTTP answer, in the format the ``Accept``
    header asks for (Prometheus text, or OpenMetrics), and its content type."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        pass  # a line per scrape would drown the service's own log


class _HTTPServer(ThreadingWSGIServer):
    """prometheus_client's threading WSGI server, for the address family of its host (IPv4 or
    IPv6; the class attribute says IPv4)."""

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, _QuietHandler)


class MetricsServer:
    """Bound at construction (a port in use is an OSError there, before a model loads);
    serves a registry from :meth:`start` on, on a daemon thread, so a scrape never waits for
    the service's event loop."""

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except socket.gaierror as exc:
            raise OSError(f"cannot listen on {host}:{port} (metrics): cannot resolve {host!r} "
                          f"({exc.strerror})") from None
        try:
            self._httpd = _HTTPServer((host, port), family)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port} (metrics): "
                          f"{exc.strerror or exc}") from None
        if ssl_context is not None:
            # as prometheus_client's own https server does: each accepted connection shakes
            # hands before its request is read
            self._httpd.socket = ssl_context.wrap_socket(self._httpd.socket, server_side=True)
        self.scheme = "http" if ssl_context is None else "https"
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """host:port, with the bound port when 0 was asked for."""
        return f"{self.host}:{self._httpd.server_address[1]}"

    def start(self, registry: CollectorRegistry) -> None:
        if self._thread is not None:
            raise RuntimeError("the metrics server is already serving")
        self._httpd.set_app(make_wsgi_app(registry))
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()


def bind_metrics(host: str, port: int | None,
                 ssl_context: ssl.SSLContext | None = None) -> MetricsServer | None:
    """A bound :class:`MetricsServer` for ``--metrics-port`` (None when not asked for), over
    TLS with ``ssl_context`` (``common.metrics.tls.metrics_ssl_context``)."""
    return None if port is None else MetricsServer(host, port, ssl_context)


def start_metrics(server: MetricsServer | None, registry: CollectorRegistry, prog: str) -> None:
    """Serve ``registry`` and print ``<prog> metrics on HOST:PORT`` (before the service's
    ready line, which is where ``flashsplit up`` stops looking for it)."""
    if server is None:
        return
    server.start(registry)
    print(f"{prog} metrics on {server.address}", flush=True)
