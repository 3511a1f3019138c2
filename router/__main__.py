"""``flashsplit-router``: the public gRPC front of a set of prefill and decode workers.

Prints ``flashsplit-router listening on HOST:PORT`` once it serves (after ``flashsplit-router
serves OpenAI HTTP on http://HOST:PORT`` with ``--http-port``, and ``flashsplit-router metrics
on HOST:PORT`` with ``--metrics-port``), and stops cleanly (health
NOT_SERVING, running requests given a grace period) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping

from common.cli_help import HelpFormatter, description
from common.lifecycle import die_with_parent_if_asked
from common.logging_setup import add_log_format_arg, configure_logging
from common.metrics.server import add_metrics_port_arg
from common.metrics.tls import metrics_ssl_context
from common.model.registry import DEFAULT_MODEL
from common.security import (add_api_key_args, add_security_args, api_key_from,
                             security_from_args)
from router.client import ClientConfig
from router.discovery import DiscoveryConfig, parse_targets
from router.dispatch import DispatchConfig
from router.limits import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_PROMPT_BYTES, RequestLimits
from router.openai_api.config import HttpConfig
from router.registry import RegistryConfig
from router.server import Router, RouterConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashsplit-router", description=description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory or a built-in name ('pycoder', 'tiny'); the router "
                        "needs its tokenizer and config, and its workers must serve the same one")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                   help="host:port of a prefill worker, or dns:///NAME:PORT for every address "
                        "NAME resolves to, resolved again every --discovery-interval "
                        "(repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR",
                   help="host:port of a decode worker, or dns:///NAME:PORT (repeatable)")
    p.add_argument("--discovery-interval", type=float, default=DiscoveryConfig.interval_s,
                   metavar="S",
                   help="seconds between resolutions of the dns:/// workers, which adds and "
                        "removes workers as the names' addresses change (default: %(default)s)")
    p.add_argument("--poll-interval", type=float, default=RegistryConfig.poll_interval_s,
                   help="seconds between load polls of each worker")
    p.add_argument("--poll-timeout", type=float, default=RegistryConfig.poll_timeout_s,
                   help="seconds a worker's load report may take before the worker counts as "
                        "down (default: %(default)s)")
    p.add_argument("--poll-misses", type=int, default=RegistryConfig.misses_before_down,
                   metavar="N",
                   help="polls in a row a healthy worker may leave unanswered in time before "
                        "it counts as down; an error answer counts at once "
                        "(default: %(default)s)")
    p.add_argument("--max-attempts", type=int, default=DispatchConfig.max_attempts,
                   help="worker pairs tried per request before giving up")
    p.add_argument("--max-queue-wait", type=float, default=DispatchConfig.max_queue_wait_s,
                   help="seconds a request waits for room while every decode worker is full, "
                        "within its deadline (default: %(default)s)")
    p.add_argument("--max-queued", type=int, default=DispatchConfig.max_queued,
                   help="requests that may wait for room at once; beyond it they are refused "
                        "with RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--first-token-after-handoff", action="store_true",
                   help="stream each request's first token from the decode worker once the "
                        "handoff is acknowledged, instead of from the prefill worker as soon "
                        "as it is sampled (the default)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="on SIGTERM, seconds running requests get to finish before they end "
                        "with finish reason ABORT")
    p.add_argument("--worker-backoff-max", type=float, default=RegistryConfig.backoff_max_s,
                   help="longest wait, in seconds, before a down worker is polled again")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt accepted, in tokens (0: what the workers' pools hold)")
    p.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                   help="longest text prompt accepted, in UTF-8 bytes")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest request message accepted on the public gRPC port")
    add_security_args(p)
    add_api_key_args(p)
    p.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API on this port, same host "
                        "(0 = any free port; default: no HTTP API)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name HTTP clients send and see (default: --model)")
    # the HTTP API serves /metrics too; this is for a router without one, or a port apart
    add_metrics_port_arg(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_log_format_arg(p)
    return p


def config_from_args(args: argparse.Namespace,
                     environ: Mapping[str, str] = os.environ) -> RouterConfig:
    """The router's settings; ValueError (or SystemExit) on a caller's mistake."""
    if not args.prefill or not args.decode:
        raise SystemExit("error: give at least one --prefill and one --decode address")
    parse_targets(args.prefill, args.decode)  # a malformed address fails before anything starts
    security = security_from_args(args, environ)
    return RouterConfig(
        model=args.model, prefill=tuple(args.prefill), decode=tuple(args.decode),
        host=args.host, port=args.port,
        registry=RegistryConfig(poll_interval_s=args.poll_interval,
                                poll_timeout_s=args.poll_timeout,
                                misses_before_down=args.poll_misses,
                                backoff_max_s=args.worker_backoff_max),
        discovery=DiscoveryConfig(interval_s=args.discovery_interval),
        clients=ClientConfig(), dispatch=DispatchConfig(
            max_attempts=args.max_attempts, max_queue_wait_s=args.max_queue_wait,
            max_queued=args.max_queued,
            first_token_from_prefill=not args.first_token_after_handoff),
        grace_s=args.grace, internal=security.internal_channel(),
        public=security.public_server(api_key_from(args, environ),
                                      client_cert=not args.public_no_client_cert),
        http=None if args.http_port is None else HttpConfig(
            host=args.host, port=args.http_port, served_model_name=args.served_model_name,
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
            require_client_cert=bool(args.tls_cert and args.tls_ca
                                     and not args.public_no_client_cert)),
        limits=RequestLimits(max_prompt_tokens=args.max_prompt_tokens,
                             max_prompt_bytes=args.max_prompt_bytes,
                             max_message_bytes=args.max_message_bytes),
        metrics_port=args.metrics_port,
        metrics_ssl_context=None if args.metrics_port is None else metrics_ssl_context(
            args.tls_cert, args.tls_key, args.tls_ca))


async def serve(config: RouterConfig) -> None:
    router = Router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await router.start()
    if router.http_address is not None:
        # before the ready line, so whoever waits for that one knows both addresses
        print(f"flashsplit-router serves OpenAI HTTP on {config.http.scheme}://"
              f"{router.http_address}",
              flush=True)
    if router.metrics_address is not None:
        print(f"flashsplit-router metrics on {router.metrics_address}", flush=True)
    print(f"flashsplit-router listening on {address}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger("router").info("shutting down")
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent_if_asked()
    configure_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is in use
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
