"""The ``tcp`` transport's frames on 127.0.0.1, in plaintext and inside TLS, without the model:
the sender's connections (``prefill_service/tcp_connections.py``) writing frames of one payload
to a handoff listener (``decode_service/tcp_listener.py``) in this process, over 1 and 2
connections. TLS takes the certificate, key and CA the workers would (``--tls-cert`` ...);
without them only plaintext is measured.

    .venv/bin/python -m benchmarks.tcp_frames [--mib 256] [--frame-mib 8]
        [--tls-cert PEM --tls-key PEM --tls-ca PEM] [--out out/tcp_frames.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from common.handoff.tcp_tls import client_context, server_context
from common.tls import TlsFiles
from decode_service.tcp_listener import TcpHandoffListener
from prefill_service.tcp_connections import Frame, TcpConnections, send_chunks

MIB = 1 << 20


def transfer_s(listener: TcpHandoffListener, connections: TcpConnections, count: int,
               frame: memoryview, spread: int) -> float:
    """Seconds to send ``count`` frames over ``spread`` connections until the listener's
    inbox has taken them all."""
    async def scenario() -> float:
        offer = listener.offer(asyncio.get_running_loop())
        held = [connections.acquire("127.0.0.1", listener.port) for _ in range(spread)]

        async def drain() -> None:
            for _ in range(count):
                item = await offer.inbox.get()
                if isinstance(item, str):
                    raise RuntimeError(item)
                item.release()

        start = time.perf_counter()
        drained = asyncio.ensure_future(drain())
        await asyncio.to_thread(send_chunks, held, offer.ticket,
                                [Frame((frame,)) for _ in range(count)])
        await drained
        elapsed = time.perf_counter() - start
        for connection in held:
            connections.release(connection)
        offer.withdraw()
        return elapsed

    return asyncio.run(scenario())


def run(mib: float, frame_mib: float, repeats: int, tls: TlsFiles | None) -> list[dict]:
    frame_bytes = int(frame_mib * MIB)
    count = max(1, int(mib * MIB) // frame_bytes)
    frame = memoryview(torch.randint(0, 256, (frame_bytes,), dtype=torch.uint8).numpy())
    rows = []
    for secure in (False, True) if tls is not None else (False,):
        listener = TcpHandoffListener(
            "127.0.0.1", 0, lambda token: True,
            ssl_context=server_context(tls, tls.root_ca is not None) if secure else None)
        connections = TcpConnections(None, ssl_context=client_context(tls) if secure else None)
        try:
            for spread in (1, 2):
                best = min(transfer_s(listener, connections, count, frame, spread)
                           for _ in range(repeats))
                rows.append({"tls": secure, "connections": spread, "frames": count,
                             "frame_bytes": frame_bytes, "best_s": best,
                             "GBps": count * frame_bytes / best / 1e9})
        finally:
            connections.close()
            listener.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=256, help="MiB per transfer")
    p.add_argument("--frame-mib", type=float, default=8, help="MiB per frame")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--out", default="out/tcp_frames.json")
    args = p.parse_args(argv)
    tls = TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca)
    rows = run(args.mib, args.frame_mib, args.repeats, tls)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
    print(f"{'path':<12} {'connections':>11} {'GB/s':>6}")
    for r in rows:
        print(f"{'TLS' if r['tls'] else 'plaintext':<12} {r['connections']:>11} "
              f"{r['GBps']:>6.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
