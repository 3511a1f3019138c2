"""Handoff cost: bytes and time to move one request's prompt state from prefill to decode.

Streams random payloads of real shapes (the built-in tiny model and a Qwen3.5-4B-shaped config)
through ``Decode.Handoff`` of a decode service running in a separate process on 127.0.0.1, for
prompt lengths 128..32k, and prints the rate next to a plain in-memory copy of the same bytes.
The model itself is not run: the decode side holds real pools and a weightless (meta) model, so
what is timed is exactly the handoff (chunking, gRPC, checksums, validation, landing in pools).

Each ``--transports`` value is measured: ``stream`` (chunks in the gRPC stream), ``stream+process``
(the same stream written by a send process, ``prefill_service/send_process.py``) and ``tcp``
(header and trailer on the stream, chunks on a TCP connection to the service's listener). With
``--tls-cert``, ``--tls-key`` and ``--tls-ca`` both ends run mutual TLS, as workers with those
flags do: the gRPC call and the TCP connections alike.

Then, in the same run, the byte path beneath it (``benchmarks/byte_path.py``): raw TCP loopback
against gRPC client streams of 1/4/16 MiB messages on 1/2/4 streams, protobuf-built against
pre-encoded messages, the copies per message and CRC-32C against CRC-32; its table is last.

    .venv/bin/python -m benchmarks.handoff [--shapes tiny,qwen3.5-4b] [--byte-path-mib 128]
        [--out out/handoff.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks import byte_path
from benchmarks.busy_engine import BusyEngine, solo_ops_per_s
from benchmarks.shapes import SHAPES, shape_config
from common.config import ModelConfig
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.handoff.payload import HandoffPayload, new_handoff_id
from common.host_malloc import tune_host_malloc
from common.model.builtin import tiny_config
from common.request_spec import RequestSpec
from common.worker_args import GIL_SWITCH_INTERVAL_S
from common.sampling import SamplingParams

PAGE_SIZE = 16
LENGTHS = (128, 512, 2048, 8192, 32768)


def config_for(shape: str) -> ModelConfig:
    return tiny_config() if shape == "tiny" else shape_config(shape)


def dtype_for(config: ModelConfig) -> torch.dtype:
    return getattr(torch, config.dtype)


def fingerprint_for(config: ModelConfig) -> str:
    return model_fingerprint(config, "benchmark:random")


async def serve(shape: str, num_pages: int, tls=None) -> None:
    """The decode side: real pools, a weightless model, the real servicer (mutual TLS with
    ``tls``, a ``TlsFiles``)."""
    from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
    from common.model.family_registry import model_class_for
    from common.security import ServerSecurity
    from decode_service.server import build_decode_service

    config = config_for(shape)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    engine_config = EngineConfig(cache=CacheConfig(page_size=PAGE_SIZE, num_pages=num_pages,
                                                   num_slots=3))
    layout = LayoutDescriptor.from_model(config, PAGE_SIZE, dtype_for(config))
    security = ServerSecurity() if tls is None else ServerSecurity(
        tls=tls, require_client_cert=tls.root_ca is not None)
    service = build_decode_service(LLMEngine(model, engine_config), layout,
                                   fingerprint_for(config), max_handoff_bytes=1 << 40,
                                   security=security)
    await service.server.start()
    print(f"listening on {service.address}", flush=True)
    await service.server.wait_for_termination()


def make_payload(config: ModelConfig, prompt_len: int) -> HandoffPayload:
    layout = LayoutDescriptor.from_model(config, PAGE_SIZE, dtype_for(config))
    gen = torch.Generator().manual_seed(prompt_len)
    fields = {}
    for name in ("kv", "conv_state", "ssm_state"):
        dtype = getattr(torch, layout.field_dtype(name))
        fields[name] = torch.randn(layout.field_shape(name, prompt_len), generator=gen).to(dtype)
    ids = torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist()
    return HandoffPayload(handoff_id=new_handoff_id(), fingerprint=fingerprint_for(config),
                          layout=layout, first_token=1, fields=fields,
                          spec=RequestSpec("", tuple(ids),
                                           SamplingParams(temperature=0.0, max_new_tokens=1)))


def copy_seconds(payload: HandoffPayload, repeats: int) -> float:
    """Best time of a plain in-memory copy of the same tensors (the floor for any transport)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for t in payload.fields.values():
            t.clone()
        best = min(best, time.perf_counter() - start)
    return best


def handoff_parts(payload: HandoffPayload, layer_chunks):
    """``(header message, chunks made as they are pulled, trailer of a count of TCP chunks)``
    as the prefill worker makes them: header and trailer through protobuf, every layer's
    bytes made into chunks by ``layer_chunks(name, layer, bytes, ledgers)`` straight from
    tensor memory, with their checksums (``prefill_service/state_reader.py``)."""
    from common import convert
    from common.handoff.ledger import fold_checksums, new_ledgers
    from common.handoff.parts import TrailerPart
    from common.handoff.stream import header_of

    header = header_of(payload)
    ledgers = new_ledgers(header.manifest)

    def chunks():
        for name, tensor in payload.fields.items():
            flat = tensor.reshape(tensor.shape[0], -1).view(torch.uint8).numpy()
            for layer in range(tensor.shape[0]):
                yield from layer_chunks(name, layer, memoryview(flat[layer]), ledgers)

    def trailer(tcp_chunks: int = 0) -> bytes:
        part = TrailerPart(fold_checksums(header.manifest, ledgers), payload.first_token,
                           tcp_chunks=tcp_chunks)
        return convert.handoff_part_to_pb(part).SerializeToString()

    return convert.handoff_part_to_pb(header).SerializeToString(), chunks(), trailer


def encoded_parts(payload: HandoffPayload, chunk_bytes: int, encode=None):
    """``handoff_parts`` with encoded chunk messages of at most ``chunk_bytes`` (the gRPC
    stream), each made by ``encode`` (default: ``encode_chunk``, a new ``bytes``)."""
    from common.handoff.chunk_codec import encode_chunk
    from prefill_service.state_reader import encode_layer

    return handoff_parts(payload, lambda name, layer, data, ledgers: encode_layer(
        name, layer, 0, data, ledgers, chunk_bytes, encode or encode_chunk))


def encoded_messages(payload: HandoffPayload, chunk_bytes: int) -> Iterator[bytes]:
    """Every message of the payload's handoff on the stream, made as they are pulled."""
    header, chunks, trailer = encoded_parts(payload, chunk_bytes)
    yield header
    yield from chunks
    yield trailer()


async def send_through_process(process, address: str, payload: HandoffPayload,
                               chunk_bytes: int, executor) -> None:
    """One handoff through a send process as a prefill worker makes it: the header, then
    the chunks encoded into its slots and written by the thread that reads them, then the
    trailer."""
    from common.pb.flashsplit.v1 import decode_pb2
    from prefill_service.handoff_sender import HANDOFF_METHOD
    from prefill_service.handoff_stream import read_reply

    call = process.call(address, HANDOFF_METHOD, 600.0, decode_pb2.HandoffReply.FromString)
    header, chunks, trailer = encoded_parts(payload, chunk_bytes, call.encode_chunk)
    await call.write(header)
    await read_reply(call, "accepted")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(executor, call.write_chunks, chunks)
    await call.write(trailer())
    await call.done_writing()
    await read_reply(call, "ack")


TCP_FRAME_BYTES = 8 << 20  # the K or V half of a StateReader piece of 16 MiB


def frame_parts(payload: HandoffPayload):
    """``handoff_parts`` with frames, as the prefill worker makes them for ``tcp``: each
    frame's payload a view of the tensor's memory, checksummed in place, never copied
    (``StateReader.frames``)."""
    from prefill_service.state_reader import frame_layer

    return handoff_parts(payload, lambda name, layer, data, ledgers: frame_layer(
        name, layer, 0, data, ledgers, TCP_FRAME_BYTES))


async def send_over_tcp(handoff, payload: HandoffPayload, connections,
                        host: str, executor, num_connections: int) -> None:
    """The ``tcp`` transport as the prefill worker runs it: header and trailer on the call,
    the chunks written as frames on a sender thread (``prefill_service/tcp_connections.py``)."""
    from prefill_service.handoff_stream import read_reply
    from prefill_service.tcp_connections import send_chunks

    header, chunks, trailer = frame_parts(payload)
    call = handoff(timeout=600.0)
    await call.write(header)
    accepted = (await read_reply(call, "accepted")).accepted
    if not accepted.tcp_port:
        raise RuntimeError("the decode service offered no TCP listener")

    def send() -> int:
        held = [connections.acquire(host, accepted.tcp_port) for _ in range(num_connections)]
        _, count = send_chunks(held, accepted.tcp_ticket, chunks)
        for connection in held:
            connections.release(connection)
        return count

    count = await asyncio.get_running_loop().run_in_executor(executor, send)
    await call.write(trailer(count))
    await call.done_writing()
    await read_reply(call, "ack")


async def measure(address: str, config: ModelConfig, lengths, repeats: int,
                  chunk_bytes: int, transport: str, tcp_connections: int = 2,
                  busy: bool = False, tls=None) -> list[dict]:
    """Best-of-``repeats`` handoffs at each of ``lengths``; with ``busy``, each beside a
    stand-in engine thread launching small ops (``benchmarks/busy_engine.py``), whose rate
    against its rate alone is the row's ``engine_x_alone``."""
    from common.channels import ChannelSecurity, make_channel
    from common.handoff.tcp_frames import tcp_host
    from common.pb.flashsplit.v1 import decode_pb2
    from prefill_service.handoff_sender import (CHUNK_PREFIX_BYTES, HANDOFF_METHOD,
                                                send_handoff)
    from prefill_service.process_call import SendProcess, SendProcessConfig
    from prefill_service.tcp_connections import TcpConnections
    from common.handoff.tcp_tls import client_context

    rows = []
    executor = ThreadPoolExecutor(max_workers=1)
    connections = TcpConnections(None, ssl_context=None if tls is None else client_context(tls))
    process = (SendProcess(SendProcessConfig(chunk_bytes + CHUNK_PREFIX_BYTES),
                           ChannelSecurity(tls=tls)) if transport == "stream+process" else None)
    if process is not None:
        process.start()  # started before the clock, as a worker starts it
    async with make_channel(address, ChannelSecurity(tls=tls)) as channel:
        handoff = channel.stream_stream(HANDOFF_METHOD, request_serializer=None,
                                        response_deserializer=decode_pb2.HandoffReply.FromString)

        class Stub:  # send_handoff's view of a stub: pre-encoded messages go out as they are
            Handoff = staticmethod(handoff)

        for n in lengths:
            best, engine_rates = float("inf"), []
            solo = solo_ops_per_s() if busy else None
            for _ in range(repeats):
                payload = make_payload(config, n)  # a fresh handoff id each time
                with BusyEngine() if busy else contextlib.nullcontext() as engine:
                    start = time.perf_counter()
                    if transport == "tcp":
                        await send_over_tcp(handoff, payload, connections, tcp_host(address),
                                            executor, tcp_connections)
                    elif process is not None:  # the send process writes it, as prefill's
                        await send_through_process(process, address, payload, chunk_bytes,
                                                   executor)
                    else:  # encoded on a thread while the loop writes, as prefill does
                        await send_handoff(Stub, encoded_messages(payload, chunk_bytes),
                                           600.0, executor)
                    best = min(best, time.perf_counter() - start)
                if busy:
                    engine_rates.append(engine.ops_per_s / solo)
            nbytes = sum(t.numel() * t.element_size() for t in payload.fields.values())
            copy_s = copy_seconds(payload, repeats)
            label = (f"tcp x{tcp_connections}" if transport == "tcp" else transport) + \
                (" tls" if tls is not None else "")
            rows.append({"transport": label + (" busy" if busy else ""), "prompt_len": n,
                         "bytes": nbytes, "busy_engine": busy,
                         "engine_x_alone": (sum(engine_rates) / len(engine_rates)
                                            if busy else None),
                         "handoff_s": best, "handoff_MBps": nbytes / best / 1e6,
                         "memcpy_s": copy_s, "memcpy_MBps": nbytes / copy_s / 1e6,
                         "slowdown_vs_memcpy": best / copy_s})
    connections.close()
    if process is not None:
        process.close()
    return rows


def run_shape(shape: str, lengths, repeats: int, transports,
              tcp_connections: list[int], busy: list[bool] = (False,),
              tls_flags: tuple[str, ...] = ()) -> list[dict]:
    """``tls_flags``: ``--tls-cert PEM --tls-key PEM --tls-ca PEM`` for both ends, or none."""
    from common.tls import TlsFiles
    from prefill_service.handoff_sender import DEFAULT_CHUNK_BYTES

    config = config_for(shape)
    num_pages = max(lengths) // PAGE_SIZE + 2
    tls = TlsFiles.load(*tls_flags[1::2]) if tls_flags else None
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.handoff", "--serve", shape,
                               "--num-pages", str(num_pages), *tls_flags],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"decode server for {shape} did not start: {line!r}")
        rows = []
        for transport in transports:
            for n in tcp_connections if transport == "tcp" else [0]:
                for beside in busy:
                    rows += asyncio.run(measure(line.split()[-1], config, lengths, repeats,
                                                DEFAULT_CHUNK_BYTES, transport, n, beside, tls))
    finally:
        server.terminate()
        server.wait()
    return [{"shape": shape, **r} for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="tiny,qwen3.5-4b",
                   help=f"comma-separated: tiny,{','.join(SHAPES)}")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="stream,tcp",
                   help="comma-separated: stream (chunks in the gRPC stream), stream+process "
                        "(the same, written by a send process as a GPU prefill worker's are), "
                        "tcp (chunks on TCP connections beside it)")
    p.add_argument("--tcp-connections", default="1,2",
                   help="comma-separated connection counts per handoff to measure for tcp")
    p.add_argument("--busy-engine", action="store_true",
                   help="also measure each handoff beside a stand-in engine thread launching "
                        "small ops in the sender's process, as a prefill worker's forward "
                        "does (its GIL), and report that thread's rate against its rate alone")
    p.add_argument("--out", default="out/handoff.json")
    p.add_argument("--byte-path-mib", type=float, default=128,
                   help="MiB per transfer in the byte-path measurement (0: skip it)")
    p.add_argument("--raw-tcp-only", action="store_true",
                   help="in the byte-path measurement, only raw TCP (the baseline), not the "
                        "gRPC cases")
    p.add_argument("--byte-path-only", action="store_true",
                   help="measure only the byte path, not whole handoffs")
    p.add_argument("--tls-cert", default=None, help="with --tls-key and --tls-ca: mutual TLS")
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--num-pages", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as in a worker's process
    tune_host_malloc()
    tls_flags = ()
    if args.tls_cert or args.tls_key or args.tls_ca:
        if not (args.tls_cert and args.tls_key and args.tls_ca):
            p.error("--tls-cert, --tls-key and --tls-ca go together")
        tls_flags = ("--tls-cert", args.tls_cert, "--tls-key", args.tls_key, "--tls-ca",
                     args.tls_ca)
    if args.serve:
        from common.tls import TlsFiles

        asyncio.run(serve(args.serve, args.num_pages,
                          TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca)))
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    if not args.byte_path_only:
        for shape in args.shapes.split(","):
            rows += run_shape(shape, lengths, args.repeats, args.transports.split(","),
                              [int(n) for n in args.tcp_connections.split(",")],
                              [False, True] if args.busy_engine else [False], tls_flags)
    transport = (byte_path.run(args.byte_path_mib, max(args.repeats, 7),
                               [] if args.raw_tcp_only else None)
                 if args.byte_path_mib > 0 else None)
    # against one raw connection: each handoff travels on one (stream or TCP)
    raw = (next(t["GBps"] for t in transport["transfers"] if t.get("connections") == 1)
           * 1e3 if transport else None)
    for r in rows:
        r["x_raw_tcp"] = r["handoff_MBps"] / raw if raw else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows,
                               "byte_path": transport}, indent=2))
    if transport is not None:
        byte_path.print_tables(transport)
    if rows:
        print(f"\nwhole handoffs ('x raw TCP': against one raw TCP connection, "
              f"{raw / 1e3:.2f} GB/s, in this run)" if raw else "")
        print_rows(rows)
    print(f"wrote {out}")
    return 0


def print_rows(rows: list[dict]) -> None:
    busy = any(r.get("busy_engine") for r in rows)
    via = max([13, *(len(r["transport"]) for r in rows)])
    print(f"{'shape':<12} {'via':<{via}} {'prompt':>7} {'MiB':>9} {'handoff ms':>11} {'MB/s':>8} "
          f"{'memcpy MB/s':>12} {'x memcpy':>9} {'x raw TCP':>9}"
          + (f" {'engine x alone':>15}" if busy else ""))
    for r in rows:
        x_raw = "" if r.get("x_raw_tcp") is None else f"{r['x_raw_tcp']:.2f}"
        engine = "" if r.get("engine_x_alone") is None else f"{r['engine_x_alone']:.2f}"
        print(f"{r['shape']:<12} {r['transport']:<{via}} {r['prompt_len']:>7} "
              f"{r['bytes'] / 2**20:>9.2f} "
              f"{r['handoff_s'] * 1e3:>11.1f} {r['handoff_MBps']:>8.0f} "
              f"{r['memcpy_MBps']:>12.0f} {r['slowdown_vs_memcpy']:>9.1f} {x_raw:>9}"
              + (f" {engine:>15}" if busy else ""))


if __name__ == "__main__":
    sys.exit(main())
