"""encode_chunk gives protobuf's bytes exactly; decode_chunk reads what protobuf reads, or
declines (None) and leaves the message to protobuf; never a different answer."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError

from common.handoff.chunk_codec import (chunk_prefix, decode_chunk, encode_chunk,
                                        encode_chunk_into)
from common.pb.flashsplit.v1 import decode_pb2 as pb
from tests.common.handoff.gil_probe import counter_moves

CASES = [("kv", 0, 0, b""), ("kv", 0, 0, b"x"), ("ssm_state", 3, 1 << 20, bytes(range(256))),
         ("conv_state", (1 << 32) - 1, (1 << 64) - 1, b"\x00" * 1000), ("", 1, 2, b"ab"),
         ("dflash_context", 127, 128, b"y" * 300), ("é", 128, 16383, b"z" * 16384),
         ("kv", 5, 7, bytes(range(256)) * 8192 + b"tail")]  # 2 MiB: filled without the GIL


def protobuf_bytes(field, layer, offset, data) -> bytes:
    return pb.HandoffMessage(chunk=pb.TensorChunk(field=field, layer=layer, offset=offset,
                                                  data=data)).SerializeToString()


@pytest.mark.parametrize("field,layer,offset,data", CASES)
def test_encode_matches_protobuf_and_decodes_back(field, layer, offset, data):
    encoded = encode_chunk(field, layer, offset, data)
    assert encoded == protobuf_bytes(field, layer, offset, data)
    assert encoded.startswith(chunk_prefix(field, layer, offset, len(data)))
    chunk = decode_chunk(encoded)
    assert (chunk.field, chunk.layer, chunk.offset, bytes(chunk.data)) == (field, layer, offset,
                                                                             data)
    assert chunk.data.readonly


def test_any_buffer_is_encoded_as_its_bytes():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    expected = protobuf_bytes("kv", 1, 8, t.numpy().tobytes())
    assert encode_chunk("kv", 1, 8, t.numpy()) == expected
    assert encode_chunk("kv", 1, 8, memoryview(t.numpy())) == expected
    assert encode_chunk("kv", 1, 8, bytearray(t.numpy().tobytes())) == expected
    with pytest.raises(ValueError, match="contiguous"):
        encode_chunk("kv", 1, 8, t.numpy()[:, 1])
    for bad in ({"layer": -1}, {"layer": 1 << 32}, {"offset": 1 << 64}, {"offset": -1}):
        args = {"field": "kv", "layer": 0, "offset": 0, **bad}
        with pytest.raises(ValueError):
            chunk_prefix(nbytes=1, **args)


def test_a_large_chunk_is_encoded_with_the_gil_released():
    data = memoryview(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8))
    encoded = []
    moved = counter_moves(lambda: encoded.append(encode_chunk("kv", 1, 0, data)))
    assert min(moved) > 1000, moved  # bytes.join over a memoryview held it: 0
    assert decode_chunk(encoded[-1]).data == data


def test_encoding_into_a_buffer_writes_the_same_message():
    data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)
    out = np.full(6000, 7, dtype=np.uint8)
    n = encode_chunk_into(out, "dflash_context", 3, 1 << 40, data)
    assert bytes(out[:n]) == encode_chunk("dflash_context", 3, 1 << 40, data)
    assert (out[n:] == 7).all()  # nothing past the message
    with pytest.raises(ValueError, match="does not fit"):
        encode_chunk_into(np.empty(5000, dtype=np.uint8), "kv", 0, 0, data)
    with pytest.raises(ValueError, match="contiguous"):
        encode_chunk_into(out, "kv", 0, 0, data.reshape(50, 100)[:, 1])


def test_a_large_chunk_is_encoded_into_a_buffer_with_the_gil_released():
    data = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    out = np.empty(data.nbytes + 64, dtype=np.uint8)
    moved = counter_moves(lambda: encode_chunk_into(out, "kv", 1, 0, data))
    assert min(moved) > 1000, moved


def test_decoded_data_lands_in_place():
    src = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    encoded = encode_chunk("kv", 2, 100, src)
    chunk = decode_chunk(encoded)
    dst = torch.zeros(8192, dtype=torch.uint8)
    dst.numpy()[chunk.offset:chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data,
                                                                              dtype=np.uint8)
    assert torch.equal(dst[100:4196], torch.from_numpy(src))
    # a view, not a copy: it points inside the message
    view = np.frombuffer(chunk.data, dtype=np.uint8)
    assert view.ctypes.data - np.frombuffer(encoded, np.uint8).ctypes.data == len(encoded) - 4096


def test_other_parts_and_odd_forms_are_left_to_protobuf():
    header = pb.HandoffMessage(header=pb.HandoffHeader(handoff_id=5)).SerializeToString()
    trailer = pb.HandoffMessage(trailer=pb.HandoffTrailer(crc32c={"kv": 1})).SerializeToString()
    one = encode_chunk("kv", 1, 2, b"abc")
    twice = one + one                       # protobuf merges two chunk fields
    repeated_inner = protobuf_bytes("kv", 1, 2, b"abc")[:-5] + b"\x22\x03abc\x22\x03abc"
    for message in (header, trailer, twice, b"", b"\x12", one[:-1], b"\x12\x02\xff\xff"):
        assert decode_chunk(message) is None
    assert decode_chunk(repeated_inner) is None
    # an unknown field inside the chunk is skipped, as protobuf skips it
    inner = one[2:] + b"\x28\x07" + b"\x35\x01\x02\x03\x04"  # field 5 varint, 6 fixed32
    with_unknown = b"\x12" + bytes([len(inner)]) + inner
    chunk = decode_chunk(with_unknown)
    parsed = pb.HandoffMessage.FromString(with_unknown).chunk
    assert (chunk.field, chunk.layer, chunk.offset, bytes(chunk.data)) == (
        parsed.field, parsed.layer, parsed.offset, parsed.data) == ("kv", 1, 2, b"abc")


def test_never_disagrees_with_protobuf_on_mutated_messages():
    rng = random.Random(3)
    base = [encode_chunk(f, l, o, d) for f, l, o, d in CASES if d]
    declined = 0
    for _ in range(20000):
        message = bytearray(rng.choice(base))
        for _ in range(rng.randrange(1, 4)):
            if not message:
                break
            action = rng.randrange(3)
            pos = rng.randrange(len(message))
            if action == 0:
                message[pos] = rng.randrange(256)
            elif action == 1:
                del message[pos:]
            else:
                message.insert(pos, rng.randrange(256))
        message = bytes(message)
        ours = decode_chunk(message)
        if ours is None:
            declined += 1
            continue
        try:
            parsed = pb.HandoffMessage.FromString(message)
        except DecodeError:
            pytest.fail(f"decoded {message!r}, which protobuf rejects")
        assert parsed.WhichOneof("part") == "chunk"
        c = parsed.chunk
        assert (ours.field, ours.layer, ours.offset, bytes(ours.data)) == (c.field, c.layer,
                                                                           c.offset, c.data)
    assert 0 < declined < 20000
