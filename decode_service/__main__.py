"""``flashsplit-decode``: serve the Decode service for one model (and its DFLASH draft)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from common.grpc_util import bind, make_server, serve_until_signal
from common.pb.flashsplit.v1 import decode_pb2_grpc
from common.worker_args import add_worker_args, build_engine, setup_process
from decode_service.engine import DecodeEngine
from decode_service.server import DecodeServicer
from decode_service.streams import TokenStreams

SERVICE_NAME = "flashsplit.v1.Decode"


async def serve(args: argparse.Namespace) -> None:
    llm, layout, fingerprint = build_engine(args, prefill=False)
    streams = TokenStreams(asyncio.get_running_loop())
    engine = DecodeEngine(llm, streams.post)
    engine.start()
    server, health = make_server()
    address = bind(server, args.host, args.port)
    decode_pb2_grpc.add_DecodeServicer_to_server(
        DecodeServicer(engine, streams, layout, fingerprint, address,
                       max_handoff_bytes=args.max_handoff_bytes), server)
    try:
        await serve_until_signal(server, health, [SERVICE_NAME],
                                 f"flashsplit-decode listening on {address}")
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashsplit-decode", description=__doc__)
    add_worker_args(parser)
    parser.add_argument("--max-handoff-bytes", type=int, default=8 << 30,
                        help="largest handoff payload accepted")
    args = parser.parse_args(argv)
    setup_process(args.log_level)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
