"""A decode worker's view of the prefill workers' pools, for the ``device`` transport.

A header may offer the sender's pools as share handles (``prefill_service/shared_pools.py``).
When this worker allows the transport and can open them (same host, the GPU visible, shapes that
fit its own pools), the handoff arrives as pool copies instead of bytes; otherwise it falls back
to bytes, which always works. Each handle is opened once and kept until shutdown.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgpack
import torch

from common.cache.shared_memory import PeerMemory, PeerMemoryError, ShareHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourcePools:
    """The sender's pool tensors, opened here (``draft_kv`` None without its draft)."""

    kv: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor
    draft_kv: torch.Tensor | None = None


class PeerPools:
    """Opens offered pools when ``enabled``; ``ours`` are this worker's pools, for the checks."""

    def __init__(self, enabled: bool, ours: SourcePools) -> None:
        self.enabled = enabled
        self._ours = ours
        self._memory = PeerMemory()

    def open(self, offer: bytes) -> SourcePools | None:
        """The offered pools, or None to take bytes (not enabled, nothing offered, or they
        cannot be opened or used here: the reason is logged)."""
        if not self.enabled or not offer:
            return None
        try:
            handles = msgpack.unpackb(offer, raw=False)
            tensors = {name: self._memory.open_handle(ShareHandle.from_bytes(data))
                       for name, data in handles.items()
                       if name in ("kv", "conv", "ssm", "draft_kv")}
            source = SourcePools(tensors["kv"], tensors["conv"], tensors["ssm"],
                                 tensors.get("draft_kv"))
            self._check(source)
            return source
        except (PeerMemoryError, ValueError, KeyError, TypeError,
                msgpack.UnpackException) as exc:
            log.info("taking the handoff as bytes: the sender's pools cannot be used here (%s)",
                     exc)
            return None

    def _check(self, source: SourcePools) -> None:
        pairs = [("kv", source.kv, self._ours.kv), ("conv", source.conv, self._ours.conv),
                 ("ssm", source.ssm, self._ours.ssm)]
        if self._ours.draft_kv is not None and source.draft_kv is not None:
            pairs.append(("draft_kv", source.draft_kv, self._ours.draft_kv))
        for name, theirs, ours in pairs:
            # dim 1 is pages (or slots): the two pools may differ in size, in nothing else
            if (theirs.dtype != ours.dtype or theirs.dim() != ours.dim()
                    or theirs.shape[0] != ours.shape[0] or theirs.shape[2:] != ours.shape[2:]):
                raise ValueError(f"pool {name} is {theirs.dtype}{list(theirs.shape)}, ours "
                                 f"{ours.dtype}{list(ours.shape)}")

    def close(self) -> None:
        self._memory.close()
