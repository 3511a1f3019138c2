"""``flashsplit-decode``: serve the Decode service for one model."""

from __future__ import annotations

import argparse
import asyncio
import sys

from common.engine.llm_engine import LLMEngine
from common.grpc_util import bind, make_server, serve_until_signal
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.model.load import eos_token_ids_for, load_model, weights_identity
from common.pb.flashsplit.v1 import decode_pb2_grpc
from common.worker_args import (add_worker_args, dtype_from_args, engine_config_from_args,
                                setup_logging)
from decode_service.engine import DecodeEngine
from decode_service.server import DecodeServicer
from decode_service.streams import TokenStreams

SERVICE_NAME = "flashsplit.v1.Decode"


async def serve(args: argparse.Namespace) -> None:
    model = load_model(args.model, dtype=dtype_from_args(args), device=args.device)
    config = engine_config_from_args(args, prefill=False)
    layout = LayoutDescriptor.from_model(model.config, config.cache.page_size, model.dtype)
    fingerprint = model_fingerprint(model.config, weights_identity(args.model))
    streams = TokenStreams(asyncio.get_running_loop())
    eos = eos_token_ids_for(args.model, model.config)
    engine = DecodeEngine(LLMEngine(model, config, eos_token_ids=eos), streams.post)
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
    setup_logging(args.log_level)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
