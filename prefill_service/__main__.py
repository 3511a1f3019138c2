"""``flashsplit-prefill``: serve the Prefill service for one model."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from common.cli_help import HelpFormatter, description
from common.grpc_util import bind, make_server, serve_until_signal
from common.handoff.tcp_tls import client_context
from common.metrics.server import bind_metrics, start_metrics
from common.metrics.tls import metrics_ssl_context
from common.parallel.worker_group import (handoff_transport, shares_pools_at,
                                          takes_rank_streams)
from common.pb.flashsplit.v1 import prefill_pb2_grpc
from common.security import Security
from common.shutdown import GracefulShutdown
from common.worker_args import run_worker, worker_engine
from common.worker_flags import add_worker_args
from prefill_service.follower_bands import PrefillFollowerBands
from prefill_service.band_sender import BandSender
from prefill_service.leader_bands import PrefillRankStreams
from prefill_service.engine import PrefillEngine
from prefill_service.handoff_sender import (DEFAULT_CHUNK_BYTES, SENDERS, HandoffSender,
                                            uses_send_process)
from prefill_service.shared_pools import SharedPools
from prefill_service.state_reader import ModelLayers, StateReader
from prefill_service.server import PrefillServicer

SERVICE_NAME = "flashsplit.v1.Prefill"


async def serve(args: argparse.Namespace, security: Security) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the engine thread dies (non-zero)."""
    server_security = security.internal_server()
    shutdown = GracefulShutdown("prefill worker")
    # bound before the model loads: a port in use fails at once, not after minutes of loading
    server, health = make_server([*server_security.interceptors(), shutdown.interceptor()])
    address = bind(server, args.host, args.port, server_security.credentials())
    metrics_server = bind_metrics(args.host, args.metrics_port,
                                  metrics_ssl_context(args.tls_cert, args.tls_key, args.tls_ca))
    transport = handoff_transport(args, "prefill")
    # with --tp the followers start here and leave once the engine thread has stopped
    # each follower sends its own heads of a handoff (per-rank streams) with this
    with worker_engine(args, prefill=True,
                       follower_bands=partial(PrefillFollowerBands, tls=security.tls)
                       ) as (group, built):
        llm, layout, fingerprint = built.engine, built.layout, built.fingerprint
        # before the engine thread starts: the pools move into memory decode workers can open
        shared = SharedPools(llm) if shares_pools_at(args, transport) else None
        engine = PrefillEngine(llm, layout, fingerprint)
        engine.start()
        # the token goes with every handoff: decode workers take handoffs from cluster members
        reader = StateReader(*engine.pools, chunk_bytes=args.handoff_chunk_bytes,
                             model_layers=ModelLayers(layout.full_attention_layers,
                                                      layout.gdn_layers))
        sender = HandoffSender(reader, security=security.internal_channel(),
                               transport=transport, shared=shared,
                               tcp_connections=args.handoff_tcp_connections,
                               rank_streams=_rank_streams(args, security, transport, group, llm),
                               send_process=uses_send_process(args.handoff_sender, transport,
                                                              args.device),
                               send_process_started=engine.metrics.send_process_started)
        sender.start()
        servicer = PrefillServicer(engine, sender, address, llm.model.config.vocab_size,
                                   llm.eos_token_ids)
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
        start_metrics(metrics_server, engine.metrics.registry, "flashsplit-prefill")

        async def on_stop() -> None:
            await sender.close()

        try:
            return await serve_until_signal(server, health, [SERVICE_NAME],
                                            f"flashsplit-prefill listening on {address}",
                                            on_stop, args.grace, shutdown=shutdown,
                                            engine=engine)
        finally:
            engine.stop()
            if engine.error is not None or engine.is_alive:
                group.mark_broken()  # the followers may be inside a collective: end them
            if metrics_server is not None:
                metrics_server.stop()


def _rank_streams(args, security: Security, transport: str, group,
                  llm) -> PrefillRankStreams | None:
    """Rank 0's side of per-rank handoff streams, when this worker offers them."""
    if not takes_rank_streams(args, transport):
        return None
    own = BandSender(llm.model.config, 0, llm.kv_pool.kv, llm.state_pool.conv,
                     llm.state_pool.ssm, ssl_context=None if security.tls is None
                     else client_context(security.tls))
    return PrefillRankStreams(own, group.world_size, group.tp.store,
                              required=args.tp_handoff == "ranks",
                              token=security.internal_token)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsplit-prefill", description=description(__doc__),
                                     formatter_class=HelpFormatter)
    add_worker_args(parser)
    parser.add_argument("--handoff-chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help="largest handoff message payload (default: %(default)s)")
    parser.add_argument("--handoff-sender", choices=SENDERS, default="auto",
                        help="who writes the gRPC handoff stream: process (a process of its "
                             "own, whose copies of the chunks leave this process's forward "
                             "alone), thread (this process's sender threads), or auto: process "
                             "for --handoff-transport stream on a GPU (docs/protocol.md) "
                             "(default: %(default)s)")
    parser.add_argument("--handoff-tcp-connections", type=_connection_count, default=None,
                        metavar="N|auto",
                        help="TCP connections one handoff spreads its chunks over (the tcp "
                             "transport); auto: two for a payload of 192 MiB or more, else one "
                             "(docs/protocol.md) (default: auto)")
    return parser


def _connection_count(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a count of at least 1, got {text!r}")
    return count


def main(argv: list[str] | None = None) -> int:
    return run_worker(build_parser().parse_args(argv), serve)


if __name__ == "__main__":
    sys.exit(main())
