"""Reads the final parts of a held request's prompt state out of the prefill pools as encoded
handoff chunks, on a sender thread (never the engine thread).

On a GPU the gather runs on a stream of its own that first waits for the step that wrote the
state (``StateReady.ready``), and lands in pinned host memory; only this thread waits for it.
Pages and the slot of a held request are not written again until it is released, so reading
them while the engine runs other requests is safe.

Payload layouts (``common/handoff/manifest.py``): ``kv`` and ``dflash_context`` are
``[L, 2, pages, page, kv_heads, head_dim]`` (K of every page, then V), so pages ``[a, b)`` of
one layer are two byte ranges: ``[a, b)`` and ``[N + a, N + b)`` pages in, ``N`` being the
prompt's page count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.handoff.ledger import LayerLedger
from common.handoff.manifest import FieldSpec
from common.handoff.chunk_codec import encode_chunk
from prefill_service.engine import StateReady


@dataclass(frozen=True)
class PromptShape:
    """The prompt a handoff carries: its length and the page size of the pools."""

    prompt_len: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)


class StateReader:
    """Encodes pool contents as chunks of at most ``chunk_bytes``, recording each in the
    caller's checksum ledgers (``fold_checksums`` turns them into the trailer's CRCs)."""

    def __init__(self, kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 draft_kv: torch.Tensor | None, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self._kv, self._conv, self._ssm, self._draft_kv = kv, conv, ssm, draft_kv
        self.chunk_bytes = chunk_bytes
        self._stream = torch.cuda.Stream(kv.device) if kv.device.type == "cuda" else None

    def pages(self, ready: StateReady, start: int, prompt: PromptShape,
              ledgers: dict[tuple[str, int], LayerLedger]) -> list[bytes]:
        """Chunks of KV (and draft context) pages ``[start, ready.num_pages)``."""
        if ready.num_pages <= start:
            return []
        ids = list(ready.page_ids[start:ready.num_pages])
        pools = [("kv", self._kv)]
        if ready.speculative and self._draft_kv is not None:
            pools.append(("dflash_context", self._draft_kv))
        last = ready.num_pages == prompt.num_pages
        tail = prompt.num_pages * prompt.page_size - prompt.prompt_len if last else 0
        out = []
        for name, pool in pools:
            host = self._to_host(lambda: _gather(pool, ids, tail), ready)
            page_bytes = host[0, 0, 0].numel() * host.element_size()
            flat = host.view(host.shape[0], 2, -1).view(torch.uint8).numpy()
            for layer in range(host.shape[0]):
                for half in (0, 1):
                    offset = (half * prompt.num_pages + start) * page_bytes
                    out += encode_layer(name, layer, offset, memoryview(flat[layer, half]),
                                        ledgers, self.chunk_bytes)
        return out

    def states(self, ready: StateReady,
               ledgers: dict[tuple[str, int], LayerLedger]) -> list[bytes]:
        """Chunks of the request's final GDN conv and recurrent state."""
        out = []
        for name, pool in (("conv_state", self._conv), ("ssm_state", self._ssm)):
            host = self._to_host(lambda: pool[:, ready.slot].contiguous(), ready)
            flat = host.view(host.shape[0], -1).view(torch.uint8).numpy()
            for layer in range(host.shape[0]):
                out += encode_layer(name, layer, 0, memoryview(flat[layer]), ledgers,
                                    self.chunk_bytes)
        return out

    def _to_host(self, gather, ready: StateReady) -> torch.Tensor:
        if self._stream is None:
            return gather()
        with torch.cuda.stream(self._stream):
            if ready.ready is not None:
                self._stream.wait_event(ready.ready)
            device = gather()
            host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
            host.copy_(device, non_blocking=True)
        self._stream.synchronize()
        return host


def _gather(pool: torch.Tensor, page_ids: list[int], tail: int) -> torch.Tensor:
    """Pages ``page_ids`` of ``[L, pool_pages, 2, page, ...]`` as ``[L, 2, n, page, ...]``; the
    last ``tail`` token rows of the last page (stale bytes of an earlier owner) zeroed."""
    index = torch.tensor(page_ids, device=pool.device)
    out = pool[:, index].transpose(1, 2).contiguous()
    if tail:
        out[:, :, -1, out.shape[3] - tail:] = 0
    return out


def new_ledgers(manifest: dict[str, FieldSpec]) -> dict[tuple[str, int], LayerLedger]:
    """An empty checksum ledger for every layer of every field of ``manifest``."""
    return {(name, layer): LayerLedger(spec.layer_nbytes)
            for name, spec in manifest.items() for layer in range(spec.num_layers)}


def fold_checksums(manifest: dict[str, FieldSpec],
                   ledgers: dict[tuple[str, int], LayerLedger]) -> dict[str, int]:
    """The trailer's CRC of each field, from what was encoded (raises if bytes are missing)."""
    checksums = {}
    for name, spec in manifest.items():
        crc = 0
        for layer in range(spec.num_layers):
            crc = ledgers[(name, layer)].fold(crc, f"{name} layer {layer}")
        checksums[name] = crc
    return checksums


def encode_layer(name: str, layer: int, offset: int, data: memoryview,
                 ledgers: dict[tuple[str, int], LayerLedger], chunk_bytes: int) -> list[bytes]:
    """``data`` (bytes ``offset..`` of one layer of ``name``) as encoded chunks of at most
    ``chunk_bytes``, each recorded in its layer's checksum ledger."""
    ledger = ledgers[(name, layer)]
    out = []
    for start in range(0, len(data), chunk_bytes):
        piece = data[start:start + chunk_bytes]
        ledger.add(offset + start, piece, f"{name} layer {layer}")
        out.append(encode_chunk(name, layer, offset + start, piece))
    return out
