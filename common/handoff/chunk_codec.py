"""Chunk messages in protobuf wire form, written with one copy of their data and read with none.

Through the protobuf runtime (upb) a chunk's bytes are copied four times before gRPC sees them:
into a ``bytes`` object (protobuf takes no memoryview), into the message when it is built, into
the serialized string, and gRPC's own copy; the receiver copies them again when it reads
``chunk.data``. Handing gRPC pre-serialized bytes (a method registered with no serializer) skips
protobuf on the data path:

- ``encode_chunk`` returns exactly ``HandoffMessage(chunk=TensorChunk(...)).SerializeToString()``,
  made with a single copy of ``data`` (a small prefix and the buffer, copied into a new
  ``bytes`` with the GIL released when the buffer is large);
- ``decode_chunk`` reads such a message in place: the data is a memoryview into the received
  bytes, for ``np.frombuffer`` to land straight in its destination.

The wire format does not change, so either side may use protobuf instead. ``decode_chunk``
returns None for anything but one plain chunk (a header, a trailer, a field repeated, a
malformed message): parse those with ``HandoffMessage.FromString``, which then answers exactly
as protobuf would, errors included.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

# Field numbers in proto/flashsplit/v1/decode.proto: HandoffMessage.chunk = 2;
# TensorChunk.field = 1, layer = 2, offset = 3, data = 4.
_MESSAGE_CHUNK = 2
_FIELD, _LAYER, _OFFSET, _DATA = 1, 2, 3, 4
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_MAX_FIELD_NUMBER = (1 << 29) - 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def chunk_prefix(field: str, layer: int, offset: int, nbytes: int) -> bytes:
    """The bytes of an encoded chunk that come before its ``nbytes`` of data."""
    if not 0 <= layer <= _U32:
        raise ValueError(f"layer must fit a uint32, got {layer}")
    if not 0 <= offset <= _U64:
        raise ValueError(f"offset must fit a uint64, got {offset}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    # proto3 leaves out fields at their default value; so do we, to match protobuf byte for byte
    name = field.encode("utf-8")
    inner = b""
    if name:
        inner += _key(_FIELD, _LENGTH) + _varint(len(name)) + name
    if layer:
        inner += _key(_LAYER, _VARINT) + _varint(layer)
    if offset:
        inner += _key(_OFFSET, _VARINT) + _varint(offset)
    if nbytes:
        inner += _key(_DATA, _LENGTH) + _varint(nbytes)
    return _key(_MESSAGE_CHUNK, _LENGTH) + _varint(len(inner) + nbytes) + inner


def _data_bytes(data) -> memoryview:
    """``data`` (any C-contiguous buffer) as a flat view of its bytes."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("chunk data must be a C-contiguous buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def encode_chunk(field: str, layer: int, offset: int, data) -> bytes:
    """The serialized ``HandoffMessage`` carrying this chunk, with one copy of ``data`` (any
    C-contiguous buffer: bytes, memoryview, a numpy array, ...), made with the GIL released
    when ``data`` is large."""
    view = _data_bytes(data)
    prefix = chunk_prefix(field, layer, offset, view.nbytes)
    if view.nbytes < _FILL_WITHOUT_GIL_BYTES:
        return b"".join((prefix, view))
    return _joined_without_gil(prefix, view)


def encode_chunk_into(out, field: str, layer: int, offset: int, data) -> int:
    """``encode_chunk``'s message written into the start of ``out`` (a writable buffer, e.g.
    a shared memory slot) instead of a new ``bytes``; returns its length. The data's copy
    runs in numpy, which releases the GIL."""
    view = _data_bytes(data)
    prefix = chunk_prefix(field, layer, offset, view.nbytes)
    nbytes = len(prefix) + view.nbytes
    room = np.frombuffer(out, dtype=np.uint8)
    if nbytes > room.size:
        raise ValueError(f"a chunk message of {nbytes} bytes does not fit {room.size}")
    room[:len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    np.copyto(room[len(prefix):nbytes], np.frombuffer(view, dtype=np.uint8))
    return nbytes


# ``bytes.join`` holds the GIL while it copies a memoryview (CPython drops it only when every
# part is ``bytes``): a 4 MiB chunk kept the prefill worker's engine thread from launching
# kernels for about 0.4 ms. Above this size the copy runs in numpy, which releases the GIL.
_FILL_WITHOUT_GIL_BYTES = 1 << 20
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_new_bytes.restype = ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = (ctypes.py_object,)
_bytes_address.restype = ctypes.c_void_p


def bytes_without_gil(data) -> bytes:
    """``bytes(data)`` for a C-contiguous buffer, copied with the GIL released when large."""
    view = _data_bytes(data)
    if view.nbytes < _FILL_WITHOUT_GIL_BYTES:
        return bytes(view)
    return _joined_without_gil(b"", view)


def _joined_without_gil(prefix: bytes, view: memoryview) -> bytes:
    """``prefix + view`` as a new ``bytes``: made uninitialised and filled before anything else
    holds it, as C code fills ``PyBytes_FromStringAndSize(NULL, n)``; numpy's copy runs
    without the GIL."""
    out = _new_bytes(None, len(prefix) + view.nbytes)
    room = np.frombuffer((ctypes.c_ubyte * len(out)).from_address(_bytes_address(out)),
                         dtype=np.uint8)
    room[:len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    np.copyto(room[len(prefix):], np.frombuffer(view, dtype=np.uint8))
    return out


@dataclass(frozen=True)
class RawChunk:
    """A decoded chunk; ``data`` is a read-only view into the message it came from, starting at
    byte ``data_start`` of it (the message's length when the chunk has no data)."""

    field: str
    layer: int
    offset: int
    data: memoryview
    data_start: int = 0


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, next position); raises IndexError past ``end``, ValueError past 10 bytes."""
    value = shift = 0
    while True:
        if pos >= end:
            raise IndexError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def _skip(buf: memoryview, wire_type: int, pos: int, end: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, pos, end)[1]
    size = {_FIXED64: 8, _FIXED32: 4}.get(wire_type)
    if wire_type == _LENGTH:
        size, pos = _read_varint(buf, pos, end)
    if size is None or pos + size > end:
        raise ValueError("unsupported wire type or truncated field")
    return pos + size


def decode_chunk(message: bytes | memoryview) -> RawChunk | None:
    """The chunk in a serialized ``HandoffMessage``, read without copying its data; None when
    the message is not exactly one chunk with each field at most once (parse it with protobuf
    then)."""
    buf = memoryview(message)
    if buf.ndim != 1 or buf.format != "B":
        buf = buf.cast("B")
    end = len(buf)
    try:
        key, pos = _read_varint(buf, 0, end)
        if key != (_MESSAGE_CHUNK << 3 | _LENGTH):
            return None
        length, pos = _read_varint(buf, pos, end)
        if pos + length != end:  # another part or field follows: protobuf's merge rules apply
            return None
        seen: dict[int, object] = {}
        while pos < end:
            key, pos = _read_varint(buf, pos, end)
            number, wire_type = key >> 3, key & 7
            if not 0 < number <= _MAX_FIELD_NUMBER:
                return None  # protobuf rejects the message
            if number in (_FIELD, _DATA) and wire_type == _LENGTH:
                size, pos = _read_varint(buf, pos, end)
                if pos + size > end:
                    return None
                value: object = (buf[pos:pos + size], pos)
                pos += size
            elif number in (_LAYER, _OFFSET) and wire_type == _VARINT:
                value, pos = _read_varint(buf, pos, end)
            elif number in (_FIELD, _LAYER, _OFFSET, _DATA):
                return None  # a known field with another wire type
            else:  # an unknown field: skipped, as protobuf skips it
                pos = _skip(buf, wire_type, pos, end)
                continue
            if number in seen:
                return None
            seen[number] = value
        name = bytes(seen.get(_FIELD, (b"", 0))[0]).decode("utf-8")
    except (IndexError, ValueError):  # truncated, overlong or not UTF-8: protobuf reports it
        return None
    data, data_start = seen.get(_DATA, (memoryview(b""), end))
    return RawChunk(field=name, layer=seen.get(_LAYER, 0) & _U32,
                    offset=seen.get(_OFFSET, 0) & _U64, data=data.toreadonly(),
                    data_start=data_start)
