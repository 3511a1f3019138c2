"""``flashsplit-prefill``: serve the Prefill service for one model."""

from __future__ import annotations

import argparse
import asyncio
import sys

from common.engine.llm_engine import LLMEngine
from common.grpc_util import bind, make_server, serve_until_signal
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.model.load import eos_token_ids_for, load_model, weights_identity
from common.pb.flashsplit.v1 import prefill_pb2_grpc
from common.worker_args import (add_worker_args, dtype_from_args, engine_config_from_args,
                                setup_logging)
from prefill_service.engine import PrefillEngine
from prefill_service.handoff_sender import HandoffSender
from prefill_service.server import PrefillServicer

SERVICE_NAME = "flashsplit.v1.Prefill"


def build_engine(args: argparse.Namespace) -> PrefillEngine:
    model = load_model(args.model, dtype=dtype_from_args(args), device=args.device)
    config = engine_config_from_args(args, prefill=True)
    layout = LayoutDescriptor.from_model(model.config, config.cache.page_size, model.dtype)
    fingerprint = model_fingerprint(model.config, weights_identity(args.model))
    eos = eos_token_ids_for(args.model, model.config)
    return PrefillEngine(LLMEngine(model, config, eos_token_ids=eos), layout, fingerprint)


async def serve(args: argparse.Namespace) -> None:
    engine = build_engine(args)
    engine.start()
    sender = HandoffSender()
    server, health = make_server()
    address = bind(server, args.host, args.port)
    servicer = PrefillServicer(engine, sender, address, engine.engine.model.config.vocab_size,
                               engine.engine.eos_token_ids)
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
    setup_logging(args.log_level)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
