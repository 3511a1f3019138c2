"""The three kinds of handoff message as plain dataclasses (the wire form is in common/convert.py).

A handoff is one ``HeaderPart``, then ``ChunkPart``s in any order, then one ``TrailerPart``. The
header goes out before the prompt is prefilled, so the first token travels in the trailer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from common.handoff.layout import LayoutDescriptor
from common.handoff.manifest import FieldSpec
from common.logprobs import TokenLogprobs
from common.request_spec import RequestSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HeaderPart:
    """Everything but the tensor bytes and the first token: which handoff of what request, what
    model and layout, what fields follow."""

    handoff_id: int
    fingerprint: str
    layout: LayoutDescriptor
    spec: RequestSpec
    manifest: dict[str, FieldSpec] = field(default_factory=dict)
    # the sender's pools as share handles (msgpack), offered for the device transport
    source_pools: bytes = b""
    # the sender's tensor-parallel size when its ranks can each send their own heads on
    # per-rank streams (docs/protocol.md); 0: everything goes through this call's sender
    rank_streams: int = 0

    @property
    def prompt_len(self) -> int:
        return self.spec.prompt_len

    @property
    def payload_nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.manifest.values())


@dataclass(frozen=True)
class ChunkPart:
    """Bytes ``[offset, offset + len(data))`` of index ``layer`` along dim 0 of ``field``.
    ``data``: ``bytes``, a memoryview into a received message, or (landing a TCP frame) a 1-D
    uint8 CPU tensor over the frame's host buffer."""

    field: str
    layer: int
    offset: int
    data: bytes | memoryview | torch.Tensor


@dataclass(frozen=True)
class PoolCopyPart:
    """Payload pages ``[dst_start, dst_start + len(src_index))`` of every layer of ``field`` are
    the sender's pool pages ``src_index`` (for a state field: ``src_index`` is its slot)."""

    field: str
    src_index: tuple[int, ...]
    dst_start: int = 0


@dataclass(frozen=True)
class TrailerPart:
    """CRC-32C (``common.handoff.checksum.crc32c``) of each field's bytes, concatenated in (layer, offset) order, and
    the first token prefill sampled (None only in a malformed trailer)."""

    checksums: dict[str, int] = field(default_factory=dict)
    first_token: int | None = None
    # the first token's log-probabilities, when the request asks for them
    first_logprobs: TokenLogprobs | None = None
    # chunks sent on the handoff's TCP connection instead of the stream (the ``tcp`` transport)
    tcp_chunks: int = 0
    # per-rank streams: the band frames sent to each decode rank (index = decode rank)
    rank_chunks: tuple[int, ...] = ()


HandoffPart = Union[HeaderPart, ChunkPart, PoolCopyPart, TrailerPart]
