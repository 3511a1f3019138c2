"""A fake worker process (``python -m tests.router.fake_prefill`` / ``fake_decode``).

Takes the real workers' flags, serves the fakes of ``tests/router/fakes.py``, prints the real
workers' ready line and stops on SIGTERM/SIGINT, so ``router/cluster.py`` can be tested without
a model.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from tests.router.fakes import start_fake


async def _serve(kind: str, host: str, port: int) -> None:
    worker = await start_fake(kind, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"flashsplit-{kind} listening on {worker.address}", flush=True)
    await stop.wait()
    await worker.stop()


def main(kind: str) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fail-at-start", action="store_true", help="exit 3 before serving")
    args, _ = p.parse_known_args()  # the real workers' other flags are accepted and ignored
    if args.fail_at_start:
        raise SystemExit(f"fake {kind}: told to fail at start")
    asyncio.run(_serve(kind, args.host, args.port))
