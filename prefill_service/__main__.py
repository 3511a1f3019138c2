"""``flashsplit-prefill``: serve the Prefill service for one model."""

from __future__ import annotations

import argparse
import asyncio
import sys

from common.grpc_util import bind, make_server, serve_until_signal
from common.pb.flashsplit.v1 import prefill_pb2_grpc
from common.worker_args import add_worker_args, build_engine, setup_process
from prefill_service.engine import PrefillEngine
from prefill_service.handoff_sender import HandoffSender
from prefill_service.server import PrefillServicer

SERVICE_NAME = "flashsplit.v1.Prefill"


async def serve(args: argparse.Namespace) -> None:
    llm, layout, fingerprint = build_engine(args, prefill=True)
    engine = PrefillEngine(llm, layout, fingerprint)
    engine.start()
    sender = HandoffSender()
    server, health = make_server()
    address = bind(server, args.host, args.port)
    servicer = PrefillServicer(engine, sender, address, llm.model.config.vocab_size,
                               llm.eos_token_ids)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)

    async def on_stop() -> None:
        await sender.close()

    try:
        await serve_until_signal(server, health, [SERVICE_NAME],
                                 f"flashsplit-prefill listening on {address}", on_stop)
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashsplit-prefill", description=__doc__)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    setup_process(args.log_level)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
