"""``flashsplit-router``: the public gRPC front of a set of prefill and decode workers.

Prints ``flashsplit-router listening on HOST:PORT`` once it serves, and stops cleanly (health
NOT_SERVING, running requests given a grace period) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from common.lifecycle import die_with_parent_if_asked
from router.client import ClientConfig
from router.dispatch import DispatchConfig
from router.registry import RegistryConfig
from router.server import Router, RouterConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashsplit-router", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--model", default="tiny",
                   help="checkpoint directory or 'tiny'; the router needs its tokenizer and config")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                   help="host:port of a prefill worker (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR",
                   help="host:port of a decode worker (repeatable)")
    p.add_argument("--poll-interval", type=float, default=RegistryConfig.poll_interval_s,
                   help="seconds between load polls of each worker")
    p.add_argument("--max-attempts", type=int, default=DispatchConfig.max_attempts,
                   help="worker pairs tried per request before giving up")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds running requests get to finish on shutdown")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not args.prefill or not args.decode:
        raise SystemExit("error: give at least one --prefill and one --decode address")
    return RouterConfig(
        model=args.model, prefill=tuple(args.prefill), decode=tuple(args.decode),
        host=args.host, port=args.port,
        registry=RegistryConfig(poll_interval_s=args.poll_interval),
        clients=ClientConfig(), dispatch=DispatchConfig(max_attempts=args.max_attempts),
        grace_s=args.grace)


async def serve(config: RouterConfig) -> None:
    router = Router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await router.start()
    print(f"flashsplit-router listening on {address}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger("router").info("shutting down")
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent_if_asked()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
