"""Head bands: the part of a payload field one per-rank stream carries.

Between tensor-parallel workers a handoff may travel as several streams, one per pair of
ranks whose heads overlap (docs/protocol.md, "Per-rank streams"). The header's manifest still
describes the full model; a stream's chunks address *bands*: the field restricted to a range
of its split dim, laid out contiguously. The split dim is the one the ranks' pools divide:

- ``kv`` (a layer ``[2, pages, page, kv_heads, head_dim]``): KV heads, dim 3 of a layer;
- ``conv_state`` (a layer ``[conv_dim, W]``): conv channels, dim 0;
- ``ssm_state`` (a layer ``[HV, V, K]`` or ``[HV, K, V]``): value heads, dim 0.

A band is named ``field[start:stop]`` on the wire (a chunk's ``field``, a trailer checksum's
key): ``kv[0:1]`` is KV head 0 of every full-attention layer, K and V of every prompt page.
Its bytes per layer are ``layer.narrow(split_dim, start, stop - start).contiguous()``; for
the two states that is one contiguous run of the full layer too, for ``kv`` a strided one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.handoff.errors import HandoffError
from common.handoff.manifest import FieldSpec

# the split dim of each banded field, counted in its full shape (dim 0 is the layer)
SPLIT_DIMS = {"kv": 4, "conv_state": 1, "ssm_state": 1}
BANDED_FIELDS = tuple(SPLIT_DIMS)
_NAME = re.compile(r"^(kv|conv_state|ssm_state)\[(\d+):(\d+)\]$")


@dataclass(frozen=True, order=True)
class Band:
    """Indices ``[start, stop)`` of ``field``'s split dim."""

    field: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.field not in SPLIT_DIMS:
            raise ValueError(f"{self.field!r} is not a banded field ({list(SPLIT_DIMS)})")
        if not 0 <= self.start < self.stop:
            raise ValueError(f"band [{self.start}, {self.stop}) of {self.field} is empty")

    @property
    def name(self) -> str:
        return f"{self.field}[{self.start}:{self.stop}]"

    @property
    def width(self) -> int:
        return self.stop - self.start

    @classmethod
    def parse(cls, name: str) -> "Band | None":
        """The band a wire name gives, or None for a name that is not one."""
        match = _NAME.match(name)
        if match is None or int(match.group(2)) >= int(match.group(3)):
            return None
        return cls(match.group(1), int(match.group(2)), int(match.group(3)))

    def spec(self, full: FieldSpec) -> FieldSpec:
        """This band's shape and dtype in a payload whose full field is ``full``;
        INVALID_ARGUMENT when the band reaches past the field's split dim."""
        dim = SPLIT_DIMS[self.field]
        if self.stop > full.shape[dim]:
            raise HandoffError("INVALID_ARGUMENT", f"band {self.name} reaches past the "
                               f"{full.shape[dim]} of {self.field}'s dim {dim}")
        shape = list(full.shape)
        shape[dim] = self.width
        return FieldSpec(full.dtype, tuple(shape))


def band_specs(manifest: dict[str, FieldSpec], bands) -> dict[str, FieldSpec]:
    """``{band name: spec}`` of ``bands`` in the payload ``manifest`` declares."""
    return {band.name: band.spec(manifest[band.field]) for band in bands}
