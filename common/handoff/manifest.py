"""The payload fields a handoff may carry, and the check of a manifest against a layout.

A manifest maps each field present to its ``FieldSpec`` (dtype, shape). Dim 0 of every field is
its "layer": chunks address ``(field, layer, byte offset)`` inside one layer's contiguous bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.handoff.errors import HandoffError
from common.handoff.layout import LayoutDescriptor, dtype_name, to_dtype

if TYPE_CHECKING:
    import torch

# kv          [num_full_layers, 2, num_prompt_pages, page_size, kv_heads, head_dim]  model dtype
# conv_state  [num_gdn_layers, conv_dim, conv_window]                                model dtype
# ssm_state   [num_gdn_layers, HV, V, K] ("hv_v_k") or [.., HV, K, V]                ssm dtype
REQUIRED_FIELDS = ("kv", "conv_state", "ssm_state")
# Shape and dtype free, declared in the manifest; dim 0 is still the chunking "layer".
OPTIONAL_FIELDS = ("dflash_context", "logprobs", "top_k")
KNOWN_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS


@dataclass(frozen=True)
class FieldSpec:
    """dtype name and shape of one payload field."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return to_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one index along dim 0."""
        return math.prod(self.shape[1:]) * self.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "FieldSpec":
        return cls(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def validate_manifest(layout: LayoutDescriptor, prompt_len: int,
                      manifest: Mapping[str, FieldSpec]) -> None:
    """Raise INVALID_ARGUMENT unless ``manifest`` fits ``layout`` for a ``prompt_len`` prompt.

    Checks: only known field names; every required field present; required fields have exactly
    the layout's shape and dtype; every field has a real dtype and at least one dim.
    """
    if prompt_len < 1:
        raise HandoffError("INVALID_ARGUMENT", f"prompt_len must be >= 1, got {prompt_len}")
    unknown = sorted(set(manifest) - set(KNOWN_FIELDS))
    if unknown:
        raise HandoffError("INVALID_ARGUMENT",
                           f"unknown payload fields {unknown}; known: {list(KNOWN_FIELDS)}")
    missing = [f for f in REQUIRED_FIELDS if f not in manifest]
    if missing:
        raise HandoffError("INVALID_ARGUMENT", f"payload lacks required fields {missing}")
    for name, spec in manifest.items():
        try:
            to_dtype(spec.dtype)
        except ValueError:
            raise HandoffError("INVALID_ARGUMENT",
                               f"field {name!r}: unknown dtype {spec.dtype!r}") from None
        if len(spec.shape) < 1 or any(d < 0 for d in spec.shape):
            raise HandoffError("INVALID_ARGUMENT",
                               f"field {name!r}: shape {list(spec.shape)} needs >= 1 dim, none < 0")
        want_shape = layout.field_shape(name, prompt_len)
        if want_shape is not None and tuple(spec.shape) != want_shape:
            raise HandoffError("INVALID_ARGUMENT", f"field {name!r}: shape {list(spec.shape)}, "
                               f"layout needs {list(want_shape)} for {prompt_len} prompt tokens")
        want_dtype = layout.field_dtype(name)
        if want_dtype is not None and dtype_name(spec.dtype) != want_dtype:
            raise HandoffError("INVALID_ARGUMENT",
                               f"field {name!r}: dtype {spec.dtype}, layout needs {want_dtype}")
