"""``HandoffMessage`` chunks encoded straight from tensor memory.

Python protobuf copies a ``bytes`` field into the message and again when it serializes it, so a
chunk built as a message costs two copies of its payload on top of the one that takes the bytes
out of tensor memory. A chunk's encoding is simple (a length-delimited ``TensorChunk`` inside
field 2 of ``HandoffMessage``), so the sender writes its few header bytes itself and joins them
with the data: one copy. ``tests/common/handoff/test_wire.py`` checks the bytes against
``SerializeToString`` and that protobuf parses them back.
"""

from __future__ import annotations

_LEN = 2     # wire type of length-delimited fields
_VARINT = 0


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def encode_chunk(field: str, layer: int, offset: int, data: bytes | memoryview) -> bytes:
    """The serialized ``HandoffMessage(chunk=TensorChunk(field, layer, offset, data))``."""
    name = field.encode()
    inner = [_tag(1, _LEN), _varint(len(name)), name]
    # proto3 leaves zero scalars out of the encoding; so does SerializeToString
    if layer:
        inner += [_tag(2, _VARINT), _varint(layer)]
    if offset:
        inner += [_tag(3, _VARINT), _varint(offset)]
    size = len(data)
    inner += [_tag(4, _LEN), _varint(size)]
    head = b"".join(inner)
    return b"".join((_tag(2, _LEN), _varint(len(head) + size), head, data))
