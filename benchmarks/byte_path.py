"""The handoff's byte path on one host: gRPC client streams against raw TCP on 127.0.0.1.

The receiver runs in a second process (as the decode worker does) and lands every byte in one
preallocated torch tensor. Measured in one run, on the same source bytes:

- raw TCP: ``sendall`` of a memoryview, ``recv_into`` the destination, 1 and 2 connections;
- gRPC (grpc.aio, client streaming, message limits raised to fit), messages of 1/4/16 MiB on
  1/2/4 concurrent streams (on one connection, or one each), in two encodings of the same wire
  bytes (a ``HandoffMessage`` holding a ``TensorChunk``): ``protobuf`` builds messages through
  the protobuf runtime and reads ``chunk.data``; ``pre-encoded`` hands gRPC the bytes of
  ``encode_chunk`` (one copy) and reads them with ``decode_chunk`` (no copy), landing through
  ``np.frombuffer``. Each gRPC transfer follows a raw TCP one, and its ratio is to those;
- the cost of each copy a message goes through, and CRC-32C against zlib's CRC-32.

    .venv/bin/python -m benchmarks.byte_path [--mib 128] [--repeats 7] [--out out/byte_path.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from benchmarks.copy_costs import checksum_rates, copy_rates
from common.handoff.checksum import crc32c, crc32c_combine
from common.handoff.ledger import message_payload_crc
from common.handoff.chunk_codec import decode_chunk, encode_chunk
from common.pb.flashsplit.v1 import decode_pb2 as pb

MIB = 1 << 20
_SERVICE = "flashsplit.bench.ByteSink"
_TCP_HEADER = struct.Struct("<QQ")  # offset, nbytes (0: close)
_FIELD = "bench"


@dataclass(frozen=True)
class StreamCase:
    """One gRPC configuration: encoding (``protobuf`` or ``pre-encoded``), payload bytes per
    message, concurrent streams, whether each stream has its own TCP connection, and where both
    ends checksum every message with CRC-32C: ``none``, on the ``loop`` thread (over the
    payload), or on worker ``threads`` (over the payload inside the message, read in place
    without the GIL, as the workers do)."""

    encoding: str
    message_bytes: int
    streams: int
    connection_per_stream: bool = False
    crc: str = "none"

    @property
    def label(self) -> str:
        conn = "conn/stream" if self.connection_per_stream else "1 conn"
        return (f"{self.encoding} {self.message_bytes // MIB} MiB x{self.streams} {conn}"
                f"{'' if self.crc == 'none' else ' +crc32c/' + self.crc}")


def default_cases() -> list[StreamCase]:
    cases = [StreamCase(enc, size * MIB, streams) for enc in ("protobuf", "pre-encoded")
             for size in (1, 4, 16) for streams in (1, 2, 4)]
    cases += [StreamCase("pre-encoded", size * MIB, streams, connection_per_stream=True)
              for size in (1, 4) for streams in (2, 4)]
    cases += [StreamCase("pre-encoded", size * MIB, 1, crc=crc) for size in (1, 4)
              for crc in ("loop", "threads")]
    cases += [StreamCase("pre-encoded", 4 * MIB, 2, connection_per_stream=True, crc=crc)
              for crc in ("loop", "threads")]
    cases += [StreamCase("protobuf", MIB, 1, crc="threads")]
    return cases


def grpc_options(message_bytes: int) -> list[tuple[str, int]]:
    limit = message_bytes + MIB  # the payload plus the chunk's own fields
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def _payload_crc(message: bytes, payload_bytes: int) -> int:
    """CRC-32C of the last ``payload_bytes`` of ``message``, as the workers take it."""
    return message_payload_crc(message, len(message) - payload_bytes)


def _fold(crcs: list[tuple[int, int]]) -> int:
    crc = 0
    for piece, nbytes in crcs:
        crc = crc32c_combine(crc, piece, nbytes)
    return crc


# ---------------------------------------------------------------- the receiver (child process)
def _serve_tcp(dst: memoryview) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"listening on 127.0.0.1:{listener.getsockname()[1]}", flush=True)

    def connection(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(_TCP_HEADER.size)
        while True:
            if conn.recv_into(header, len(header), socket.MSG_WAITALL) < len(header):
                return
            offset, nbytes = _TCP_HEADER.unpack(header)
            if nbytes == 0:
                return
            view, got = dst[offset:offset + nbytes], 0
            while got < nbytes:
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=connection, args=(conn,), daemon=True).start()


async def _serve_grpc(nbytes: int, max_message: int) -> None:
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    land = dst.numpy()

    workers = concurrent.futures.ThreadPoolExecutor(4)
    loop = asyncio.get_running_loop()

    async def ack(total: int, crcs: list) -> bytes:
        # handoff_id carries the stream's folded CRC-32C back, for the sender to check
        pieces = [(await c if isinstance(c, asyncio.Future) else c, n) for c, n in crcs]
        return pb.HandoffAck(bytes_received=total, handoff_id=_fold(pieces)).SerializeToString()

    async def push_protobuf(requests, context):
        total, crcs, mode = 0, [], dict(context.invocation_metadata()).get("crc", "none")
        async for message in requests:
            chunk = message.chunk
            data = chunk.data  # upb makes a new bytes object on every read: read it once
            land[chunk.offset:chunk.offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            if mode == "loop":
                crcs.append((crc32c(data), len(data)))
            elif mode == "threads":
                crcs.append((loop.run_in_executor(workers, crc32c, data), len(data)))
            total += len(data)
        return await ack(total, crcs)

    async def push_raw(requests, context):
        total, crcs, mode = 0, [], dict(context.invocation_metadata()).get("crc", "none")
        async for raw in requests:
            chunk = decode_chunk(raw)
            if chunk is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a plain chunk")
            n = len(chunk.data)
            land[chunk.offset:chunk.offset + n] = np.frombuffer(chunk.data, dtype=np.uint8)
            if mode == "loop":
                crcs.append((crc32c(chunk.data), n))
            elif mode == "threads":
                crcs.append((loop.run_in_executor(workers, _payload_crc, raw, n), n))
            total += n
        return await ack(total, crcs)

    async def check(request, context):
        offset, n = _TCP_HEADER.unpack(request)
        if n == 0:  # reset
            dst.zero_()
            return b""
        return crc32c(land[offset:offset + n]).to_bytes(4, "little")

    handlers = {
        "PushProtobuf": grpc.stream_unary_rpc_method_handler(
            push_protobuf, request_deserializer=pb.HandoffMessage.FromString),
        "PushRaw": grpc.stream_unary_rpc_method_handler(push_raw),
        "Check": grpc.unary_unary_rpc_method_handler(check),
    }
    server = grpc.aio.server(options=grpc_options(max_message))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def serve(kind: str, nbytes: int, max_message: int) -> None:
    if kind == "tcp":
        _serve_tcp(memoryview(torch.zeros(nbytes, dtype=torch.uint8).numpy()))
    else:
        asyncio.run(_serve_grpc(nbytes, max_message))


class Receiver:
    """The receiving process, started with ``python -m benchmarks.byte_path --serve KIND``."""

    def __init__(self, kind: str, nbytes: int, max_message: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.byte_path", "--serve", kind, "--mib",
             str(nbytes / MIB), "--max-message", str(max_message)], stdout=subprocess.PIPE,
            text=True)
        line = self._proc.stdout.readline()
        if "listening on" not in line:
            self.close()
            raise RuntimeError(f"{kind} receiver did not start: {line!r}")
        self.address = line.split()[-1]

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- the sender (this process)
def _ranges(nbytes: int, parts: int) -> list[tuple[int, int]]:
    bounds = [nbytes * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def measure_tcp(address: str, src: memoryview, connections: int, repeats: int) -> list[float]:
    host, port = address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port))) for _ in range(connections)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def push(sock: socket.socket, start: int, end: int) -> None:
        sock.sendall(_TCP_HEADER.pack(start, end - start))
        sock.sendall(src[start:end])
        if sock.recv(1) != b"k":
            raise RuntimeError("raw TCP receiver did not acknowledge")

    times = []
    try:
        for _ in range(repeats):
            threads = [threading.Thread(target=push, args=(s, a, b))
                       for s, (a, b) in zip(socks, _ranges(len(src), connections))]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.perf_counter() - start)
    finally:
        for s in socks:
            s.sendall(_TCP_HEADER.pack(0, 0))
            s.close()
    return times


def _messages(case: StreamCase, src: memoryview, start: int, end: int, crcs: list,
              workers: concurrent.futures.Executor):
    """The stream's messages; each one's CRC-32C (or its future) goes to ``crcs``."""
    for offset in range(start, end, case.message_bytes):
        piece = src[offset:min(offset + case.message_bytes, end)]
        n = len(piece)
        if case.encoding == "protobuf":
            data = bytes(piece)  # protobuf takes bytes only: the first copy
            if case.crc == "loop":
                crcs.append((crc32c(data), n))
            elif case.crc == "threads":
                crcs.append((workers.submit(crc32c, data), n))
            yield pb.HandoffMessage(chunk=pb.TensorChunk(field=_FIELD, layer=0, offset=offset,
                                                         data=data))
        else:
            message = encode_chunk(_FIELD, 0, offset, piece)
            if case.crc == "loop":
                crcs.append((crc32c(piece), n))
            elif case.crc == "threads":
                crcs.append((workers.submit(_payload_crc, message, n), n))
            yield message


async def measure_grpc(address: str, src: memoryview, case: StreamCase, repeats: int,
                       before_each=None) -> tuple[list[float], bool]:
    """Times of ``repeats`` transfers of ``src`` on warm channels (after one untimed transfer),
    and whether the bytes landed. ``before_each()`` runs, untimed, before each timed transfer:
    the raw TCP measurement paired with it."""
    options = grpc_options(case.message_bytes)
    count = case.streams if case.connection_per_stream else 1
    # a local subchannel pool per channel: otherwise gRPC shares one TCP connection among them
    extra = [("grpc.use_local_subchannel_pool", 1)] if case.connection_per_stream else []
    channels = [grpc.aio.insecure_channel(address, options=options + extra) for _ in range(count)]
    method = "PushProtobuf" if case.encoding == "protobuf" else "PushRaw"
    serializer = pb.HandoffMessage.SerializeToString if case.encoding == "protobuf" else None
    metadata = (("crc", case.crc),)
    pushes = [ch.stream_unary(f"/{_SERVICE}/{method}", request_serializer=serializer,
                              response_deserializer=pb.HandoffAck.FromString) for ch in channels]
    check = channels[0].unary_unary(f"/{_SERVICE}/Check")
    ranges = _ranges(len(src), case.streams)
    expected = [crc32c(src[a:b]) for a, b in ranges] if case.crc != "none" else []
    workers = concurrent.futures.ThreadPoolExecutor(4)

    async def transfer() -> float:
        crcs = [[] for _ in ranges]
        start = time.perf_counter()
        acks = await asyncio.gather(*(
            pushes[i % count](_messages(case, src, a, b, crcs[i], workers), metadata=metadata)
            for i, (a, b) in enumerate(ranges)))
        sent = [_fold([(c.result() if isinstance(c, concurrent.futures.Future) else c, n)
                       for c, n in stream]) for stream in crcs]  # what the trailers would carry
        seconds = time.perf_counter() - start
        if sum(a.bytes_received for a in acks) != len(src):
            raise RuntimeError(f"{case.label}: receiver counted {acks}")
        if expected and (sent != expected or [a.handoff_id for a in acks] != expected):
            raise RuntimeError(f"{case.label}: CRC-32C differs from the source's")
        return seconds

    try:
        await check(_TCP_HEADER.pack(0, 0))  # zero the destination
        await transfer()  # connections up, flow-control windows grown: a worker's steady state
        times = []
        for _ in range(repeats):
            if before_each is not None:
                before_each()
            times.append(await transfer())
        landed = await check(_TCP_HEADER.pack(0, len(src)))
        return times, int.from_bytes(landed, "little") == crc32c(src)
    finally:
        workers.shutdown()
        for ch in channels:
            await ch.close()


# ---------------------------------------------------------------- the whole measurement
def _row(name: str, times: list[float], nbytes: int, **extra) -> dict:
    best, median = min(times), sorted(times)[len(times) // 2]
    return {"path": name, "best_s": best, "median_s": median, "GBps": nbytes / best / 1e9,
            "median_GBps": nbytes / median / 1e9, **extra}


def run(mib: float = 128, repeats: int = 7, cases: list[StreamCase] | None = None) -> dict:
    """Every measurement of this module, as one JSON-able dict. Each gRPC transfer is paired
    with a raw TCP transfer just before it; a row's ``x_raw_tcp`` is the median over its pairs
    of gRPC rate / raw rate, so that load from other processes weighs on both alike."""
    cases = default_cases() if cases is None else cases
    nbytes = int(mib * MIB)
    src = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    largest = max((c.message_bytes for c in cases), default=MIB)
    rows = []
    with Receiver("tcp", nbytes, 0) as tcp, Receiver("grpc", nbytes, largest) as receiver:
        measure_tcp(tcp.address, src, 1, 1)  # warm-up
        for conns in (1, 2):
            rows.append(_row(f"raw TCP, {conns} connection{'s' * (conns > 1)}",
                             measure_tcp(tcp.address, src, conns, repeats), nbytes,
                             kind="tcp", connections=conns))
        for case in cases:
            paired: list[float] = []
            times, landed = asyncio.run(measure_grpc(
                receiver.address, src, case, repeats,
                before_each=lambda: paired.extend(measure_tcp(tcp.address, src, 1, 1))))
            ratios = sorted(tcp_s / grpc_s for tcp_s, grpc_s in zip(paired, times))
            rows.append(_row(f"gRPC {case.label}", times, nbytes, kind="grpc", landed=landed,
                             paired_raw_tcp_GBps=nbytes / min(paired) / 1e9,
                             x_raw_tcp=ratios[len(ratios) // 2], **asdict(case)))
    raw = max(r["GBps"] for r in rows if r["kind"] == "tcp")
    for r in rows:
        r.setdefault("x_raw_tcp", r["GBps"] / raw)
    return {"date": time.strftime("%Y-%m-%d"), "bytes": nbytes, "repeats": repeats,
            "raw_tcp_GBps": raw, "grpc_version": grpc.__version__,
            "copies": copy_rates(), "checksums": checksum_rates(), "transfers": rows}


def print_tables(result: dict) -> None:
    print(f"\nper-message steps on 16 MiB{'':<34} GB/s")
    for r in result["copies"]:
        print(f"  {r['step']:<52} {r['GBps']:>6.2f}")
    print("\nchecksums on 64 MiB                                     GB/s")
    for r in result["checksums"]:
        print(f"  {r['checksum']:<52} {r['GBps']:>6.2f}")
    print(f"\n{result['bytes'] / MIB:.0f} MiB to a second process on 127.0.0.1, best of "
          f"{result['repeats']} (median in brackets)")
    print(f"  {'path':<50} {'GB/s':>6} {'(median)':>9} {'raw TCP':>8} {'x raw':>6} "
          f"{'landed':>6}")
    for r in result["transfers"]:
        landed = "" if r["kind"] == "tcp" else ("yes" if r["landed"] else "NO")
        paired = r.get("paired_raw_tcp_GBps", result["raw_tcp_GBps"])
        print(f"  {r['path']:<50} {r['GBps']:>6.2f} {r['median_GBps']:>9.2f} {paired:>8.2f} "
              f"{r['x_raw_tcp']:>6.2f} {landed:>6}")
    print("  (raw TCP: the best raw transfer paired with the row's; x raw: the median ratio of "
          "the pairs)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=128, help="bytes moved per transfer, in MiB")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="out/byte_path.json")
    p.add_argument("--serve", choices=("tcp", "grpc"), help=argparse.SUPPRESS)
    p.add_argument("--max-message", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, int(args.mib * MIB), args.max_message)
        return 0
    result = run(args.mib, args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
