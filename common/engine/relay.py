"""Device buffers that carry per-request values from one decode step (or a handoff) to the next.

Each field (next token ids, accept lengths, top-k probabilities, DFLASH context, ...) has one
buffer ``[max_slots, *per_slot_shape]`` indexed by request slot, so step n+1 gathers step n's
outputs on the device without a host sync.

NOTE: buffers are created per field, the first time that field is written, with that write's
per-slot shape and dtype. Never freeze the set of fields from the first payload: a first payload
without top-k (a prefill handoff, say) must not disable top-k for the payloads that do carry it
(SGLang's FutureMap regression, reference/disagg.md §2.4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class RelayError(LookupError):
    """A read of a field never written, or a write that does not fit the field's buffer."""


SlotIds = Sequence[int] | torch.Tensor


class PayloadRelay:
    """Per-field device buffers indexed by request slot.

    Args:
        max_slots: number of rows in every buffer; slot ids are in ``[0, max_slots)``.
        device: where the buffers live.

    Slot ids given as a Python sequence or a CPU tensor are range-checked; device tensors are not
    (checking would sync with the device and break CUDA-graph capture).
    """

    def __init__(self, max_slots: int, device: torch.device | str = "cpu") -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}
        # per field, which rows hold a value written since the row was last cleared
        self._written: dict[str, torch.Tensor] = {}

    def has(self, field: str) -> bool:
        """Whether ``field`` has a buffer (it was written at least once)."""
        return field in self._buffers

    def fields(self) -> tuple[str, ...]:
        return tuple(self._buffers)

    def spec(self, field: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Per-slot shape and dtype of ``field``'s buffer."""
        buf = self._buffer(field)
        return tuple(buf.shape[1:]), buf.dtype

    def write(self, field: str, slot_ids: SlotIds, values: torch.Tensor) -> None:
        """Store ``values[i]`` as ``field`` of slot ``slot_ids[i]``; ``values`` is
        ``[len(slot_ids), *per_slot_shape]``. Creates the field's buffer on its first write."""
        idx = self._index(slot_ids)
        if values.dim() < 1 or values.shape[0] != idx.shape[0]:
            raise RelayError(f"write of {field!r}: values of shape {tuple(values.shape)} for "
                             f"{idx.shape[0]} slots; dim 0 must be the slot count")
        buf = self._buffers.get(field)
        if buf is None:
            buf = torch.zeros((self.max_slots, *values.shape[1:]), dtype=values.dtype,
                              device=self.device)
            self._buffers[field] = buf
            self._written[field] = torch.zeros(self.max_slots, dtype=torch.bool,
                                               device=self.device)
        elif tuple(buf.shape[1:]) != tuple(values.shape[1:]) or buf.dtype != values.dtype:
            raise RelayError(f"write of {field!r}: per-slot {tuple(values.shape[1:])} "
                             f"{values.dtype}, but its buffer holds {tuple(buf.shape[1:])} "
                             f"{buf.dtype}")
        buf.index_copy_(0, idx, values.to(self.device, non_blocking=True))
        self._written[field].index_fill_(0, idx, True)

    def write_all(self, slot_ids: SlotIds, values: Mapping[str, torch.Tensor | None]) -> None:
        """``write`` every field of ``values`` that is not None; a None (absent) field is skipped
        and keeps its buffer, if any, for later payloads."""
        for field, tensor in values.items():
            if tensor is not None:
                self.write(field, slot_ids, tensor)

    def read(self, field: str, slot_ids: SlotIds, *, require_written: bool = False) -> torch.Tensor:
        """Gather ``field`` for ``slot_ids``: ``[len(slot_ids), *per_slot_shape]``.

        ``require_written`` also checks that every row was written since it was last cleared
        (a host sync, so for debugging and tests, not the hot loop).
        """
        buf = self._buffer(field)
        idx = self._index(slot_ids)
        if require_written:
            written = self._written[field].index_select(0, idx)
            if not bool(written.all()):
                missing = idx[~written].tolist()
                raise RelayError(f"field {field!r} was not written for slots {missing} since "
                                 f"they were last cleared")
        return buf.index_select(0, idx)

    def clear(self, slot_ids: SlotIds) -> None:
        """Zero every field of ``slot_ids`` (their requests finished), so that no value leaks to
        the next request in the same slot."""
        idx = self._index(slot_ids)
        for field, buf in self._buffers.items():
            buf.index_fill_(0, idx, 0)
            self._written[field].index_fill_(0, idx, False)

    # internals
    def _buffer(self, field: str) -> torch.Tensor:
        buf = self._buffers.get(field)
        if buf is None:
            raise RelayError(f"field {field!r} has never been written to the relay; fields "
                             f"present: {sorted(self._buffers)}")
        return buf

    def _index(self, slot_ids: SlotIds) -> torch.Tensor:
        if isinstance(slot_ids, torch.Tensor):
            if slot_ids.dim() != 1:
                raise RelayError(f"slot ids must be 1-D, got shape {tuple(slot_ids.shape)}")
            idx = slot_ids.to(torch.long)
        else:
            idx = torch.tensor(list(slot_ids), dtype=torch.long)
        if idx.device.type == "cpu" and idx.numel():
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.max_slots:
                raise RelayError(f"slot ids must be in [0, {self.max_slots}), got {low}..{high}")
        return idx.to(self.device, non_blocking=True)
