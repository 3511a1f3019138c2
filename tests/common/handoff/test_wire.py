"""Hand-encoded chunks are byte for byte what protobuf writes, and parse back."""

from __future__ import annotations

import numpy as np
import pytest

from common.handoff.wire import encode_chunk
from common.pb.flashsplit.v1 import decode_pb2


@pytest.mark.parametrize("layer,offset,size", [(0, 0, 1), (3, 0, 127), (0, 5, 128),
                                               (200, 1 << 33, 70_001), (1, 16384, 1 << 20)])
def test_chunk_encoding_equals_protobuf(layer, offset, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    ours = encode_chunk("ssm_state", layer, offset, memoryview(data))
    ref = decode_pb2.HandoffMessage(chunk=decode_pb2.TensorChunk(
        field="ssm_state", layer=layer, offset=offset, data=data.tobytes())).SerializeToString()
    assert ours == ref
    back = decode_pb2.HandoffMessage.FromString(ours).chunk
    assert (back.field, back.layer, back.offset, back.data) == ("ssm_state", layer, offset,
                                                                data.tobytes())
