"""Which prefill rank sends which heads to which decode rank: the range arithmetic of per-rank
handoff streams between a prefill worker of tensor-parallel size ``src_tp`` and a decode worker
of ``dst_tp`` (docs/tensor_parallel.md, "Per-rank handoff streams").

Each rank's pools hold its heads along each banded field's split dim
(``common/handoff/bands.py``): its KV heads, its conv channels (its key heads' q and k, its
value heads' v), its value heads' recurrent state, as ``ShardPlan`` gives its weights. A head
held by several prefill ranks (replicated KV or key heads) is sent by the lowest of them only,
so every byte leaves prefill once; a head several decode ranks hold goes to each of them. A
transfer is one band from one prefill rank to one decode rank: the intersection of a range
the sender owns with a range the receiver holds, so it lies inside one range of each and is
contiguous in both ranks' pools.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ModelConfig
from common.handoff.bands import Band
from common.parallel.shard_plan import Ranges, gdn_conv_channels, shard_heads


@dataclass(frozen=True)
class Transfer:
    """Band ``band`` goes from prefill rank ``src`` to decode rank ``dst``."""

    src: int
    dst: int
    band: Band


@dataclass(frozen=True)
class RankStreamPlan:
    """What every prefill rank needs to send its bands of one handoff: the decode worker's
    host, one listener port per decode rank (index = decode rank), the ticket its frames
    carry, the cluster's internal token for the listeners' hello, and the prompt's shape."""

    host: str
    ports: tuple[int, ...]
    ticket: bytes
    token: str | None
    prompt_len: int
    page_size: int
    src_tp: int

    @property
    def dst_tp(self) -> int:
        return len(self.ports)

    @property
    def num_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)


def held_ranges(config: ModelConfig, rank: int, world_size: int) -> dict[str, Ranges]:
    """The ranges of each banded field's split dim that rank ``rank`` of ``world_size`` holds
    in its pools, in the order its pools keep them. Raises ShardingError for a size that does
    not divide the heads."""
    att = shard_heads("attention", config.num_attention_heads, config.num_key_value_heads,
                      rank, world_size)
    gdn = shard_heads("GDN", config.linear_num_value_heads, config.linear_num_key_heads,
                      rank, world_size)
    return {"kv": ((att.groups.start, att.groups.stop),),
            "conv_state": gdn_conv_channels(config, gdn),
            "ssm_state": ((gdn.heads.start, gdn.heads.stop),)}


def owned_pieces(config: ModelConfig, world_size: int) -> dict[str, list[tuple[int, int, int]]]:
    """``{field: [(start, stop, rank)]}``: every index of each split dim once, with the lowest
    rank that holds it (the one that sends it)."""
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for rank in range(world_size):
        for name, ranges in held_ranges(config, rank, world_size).items():
            taken = pieces.setdefault(name, [])
            for start, stop in ranges:
                for lo, hi in _uncovered(start, stop, taken):
                    taken.append((lo, hi, rank))
    return pieces


def _uncovered(start: int, stop: int, taken: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` no piece of ``taken`` covers."""
    left = [(start, stop)]
    for a, b, _ in taken:
        left = [piece for lo, hi in left
                for piece in ((lo, min(hi, a)), (max(lo, b), hi)) if piece[0] < piece[1]]
    return left


def transfers(config: ModelConfig, src_tp: int, dst_tp: int) -> tuple[Transfer, ...]:
    """Every band that moves, sender by sender, then receiver, then field and start."""
    owned = owned_pieces(config, src_tp)
    out = []
    for dst in range(dst_tp):
        for name, ranges in held_ranges(config, dst, dst_tp).items():
            for start, stop in ranges:
                for a, b, src in owned[name]:
                    lo, hi = max(a, start), min(b, stop)
                    if lo < hi:
                        out.append(Transfer(src, dst, Band(name, lo, hi)))
    return tuple(sorted(out, key=lambda t: (t.src, t.dst, t.band)))


def bands_from(config: ModelConfig, src_tp: int, dst_tp: int, src: int) -> dict[Band, tuple[int, ...]]:
    """The bands prefill rank ``src`` sends, each with the decode ranks it goes to."""
    out: dict[Band, list[int]] = {}
    for t in transfers(config, src_tp, dst_tp):
        if t.src == src:
            out.setdefault(t.band, []).append(t.dst)
    return {band: tuple(dsts) for band, dsts in out.items()}


def bands_to(config: ModelConfig, src_tp: int, dst_tp: int, dst: int) -> tuple[Band, ...]:
    """The bands decode rank ``dst`` receives (from any prefill rank)."""
    return tuple(sorted({t.band for t in transfers(config, src_tp, dst_tp) if t.dst == dst}))


def local_start(ranges: Ranges, band: Band) -> int:
    """Where ``band`` starts in a pool that holds ``ranges`` of its field's split dim,
    concatenated; ValueError when no one range holds all of it."""
    at = 0
    for start, stop in ranges:
        if start <= band.start and band.stop <= stop:
            return at + band.start - start
        at += stop - start
    raise ValueError(f"band {band.name} is not inside one of the ranges {list(ranges)}")
