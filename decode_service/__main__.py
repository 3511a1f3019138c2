"""``flashsplit-decode``: serve the Decode service for one model (and its DFLASH draft)."""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from common.cli_help import HelpFormatter, description
from common.grpc_util import serve_until_signal
from common.metrics.server import bind_metrics, start_metrics
from common.metrics.tls import metrics_ssl_context
from common.parallel.worker_group import (handoff_transport, shares_pools_at,
                                          takes_rank_streams)
from common.security import Security
from common.worker_args import run_worker, worker_engine
from common.worker_flags import add_worker_args
from decode_service.follower_bands import DecodeFollowerBands
from decode_service.server import build_decode_service

SERVICE_NAME = "flashsplit.v1.Decode"
log = logging.getLogger("flashsplit-decode")


async def serve(args: argparse.Namespace, security: Security) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the engine thread dies (non-zero)."""
    server_security = security.internal_server()
    # bound before the model loads: a port in use fails at once
    metrics_server = bind_metrics(args.host, args.metrics_port,
                                  metrics_ssl_context(args.tls_cert, args.tls_key, args.tls_ca))
    transport = handoff_transport(args, "decode")
    # with --tp the followers start here and leave once the engine thread has stopped
    # each follower lands its own heads of a handoff (per-rank streams) with this
    bands = partial(DecodeFollowerBands, tls=server_security.tls,
                    require_client_cert=server_security.require_client_cert)
    with worker_engine(args, prefill=False, follower_bands=bands) as (group, built):
        llm, layout, fingerprint = built.engine, built.layout, built.fingerprint
        service = build_decode_service(llm, layout, fingerprint, host=args.host,
                                       port=args.port, max_handoff_bytes=args.max_handoff_bytes,
                                       security=server_security, transport=transport,
                                       idle_timeout_s=args.handoff_idle_timeout,
                                       handoff_port=args.handoff_port,
                                       open_peer_pools=shares_pools_at(args, transport),
                                       rank_streams=takes_rank_streams(args, transport),
                                       band_token=security.internal_token)
        start_metrics(metrics_server, service.engine.metrics.registry, "flashsplit-decode")
        if service.tcp is not None:
            log.info("handoff chunks over TCP: listening on port %d", service.tcp.port)
        if service.rank_streams is not None:
            log.info("per-rank handoff streams: rank listeners on ports %s",
                     list(service.rank_streams.ports))
        try:
            return await serve_until_signal(
                service.server, service.health, [SERVICE_NAME],
                f"flashsplit-decode listening on {service.address}", grace=args.grace,
                shutdown=service.shutdown, engine=service.engine)
        finally:
            service.close_tcp()
            service.engine.stop()
            if service.engine.error is not None or service.engine.is_alive:
                group.mark_broken()  # the followers may be inside a collective: end them
            if metrics_server is not None:
                metrics_server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsplit-decode", description=description(__doc__),
                                     formatter_class=HelpFormatter)
    add_worker_args(parser)
    parser.add_argument("--max-handoff-bytes", type=int, default=8 << 30,
                        help="largest handoff payload accepted (default: %(default)s)")
    parser.add_argument("--handoff-port", type=int, default=0,
                        help="TCP port of the listener that takes handoff chunks beside the "
                             "gRPC stream (--handoff-transport auto or tcp); 0 picks a free "
                             "one (it is printed)")
    parser.add_argument("--handoff-idle-timeout", type=float, default=60.0,
                        help="seconds a handoff may send nothing before its room is released "
                             "(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_worker(build_parser().parse_args(argv), serve)


if __name__ == "__main__":
    sys.exit(main())
