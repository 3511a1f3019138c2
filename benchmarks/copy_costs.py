"""What one handoff message's bytes cost on the host, step by step: the copies on the way into
and out of gRPC (through protobuf, or pre-encoded with ``common.handoff.chunk_codec``), the
landing in a tensor, and CRC-32C against zlib's CRC-32. ``benchmarks/byte_path.py`` prints
these next to the transfer rates they explain.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from common.handoff.checksum import crc32c
from common.handoff.chunk_codec import decode_chunk, encode_chunk
from common.pb.flashsplit.v1 import decode_pb2 as pb

MIB = 1 << 20
_FIELD = "bench"


def _best_seconds(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_rates(nbytes: int = 16 * MIB) -> list[dict]:
    """GB/s of each step a message's bytes go through, on one message of ``nbytes``."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    view = memoryview(src.numpy())
    data = bytes(view)
    message = pb.HandoffMessage(chunk=pb.TensorChunk(field=_FIELD, offset=1, data=data))
    wire = message.SerializeToString()
    steps = {
        "memcpy (torch copy_ into a preallocated tensor)": lambda: dst.copy_(src),
        "bytes(memoryview)": lambda: bytes(view),
        "tensor.numpy().tobytes()": lambda: src.numpy().tobytes(),
        "memoryview.tobytes()": lambda: view.tobytes(),
        "encode_chunk (prefix + memoryview, bytes.join)": lambda: encode_chunk(_FIELD, 0, 1,
                                                                               view),
        "protobuf: TensorChunk(data=bytes)": lambda: pb.HandoffMessage(
            chunk=pb.TensorChunk(field=_FIELD, offset=1, data=data)),
        "protobuf: SerializeToString": message.SerializeToString,
        "protobuf: FromString": lambda: pb.HandoffMessage.FromString(wire),
        "protobuf: reading chunk.data": lambda: message.chunk.data,
        "decode_chunk (a view, no copy)": lambda: decode_chunk(wire),
        "land: np.frombuffer into the tensor": lambda: dst.numpy().__setitem__(
            slice(None), np.frombuffer(data, dtype=np.uint8)),
        "bytearray(bytes) (copy before torch.frombuffer)": lambda: bytearray(data),
    }
    return [{"step": name, "seconds": s, "GBps": nbytes / s / 1e9}
            for name, fn in steps.items() for s in [_best_seconds(fn)]]


def checksum_rates(nbytes: int = 64 * MIB) -> list[dict]:
    """GB/s of CRC-32C (``common.handoff.checksum.crc32c``) and zlib's CRC-32 over ``nbytes``."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    as_bytes = data.tobytes()
    steps = {"crc32c (bytes)": lambda: crc32c(as_bytes),
             "crc32c (numpy view)": lambda: crc32c(data),
             "zlib.crc32 (bytes)": lambda: zlib.crc32(as_bytes)}
    return [{"checksum": name, "seconds": s, "GBps": nbytes / s / 1e9}
            for name, fn in steps.items() for s in [_best_seconds(fn)]]
