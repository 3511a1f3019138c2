"""What moves from prefill to decode for one request (the in-memory form of a handoff)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.handoff.layout import LayoutDescriptor
from common.handoff.manifest import FieldSpec, validate_manifest
from common.logprobs import TokenLogprobs
from common.request_spec import RequestSpec

if TYPE_CHECKING:
    import torch


def new_handoff_id() -> int:
    """A random uint64 handoff id; never 0, which the wire format reserves for "unset"."""
    while True:
        value = secrets.randbits(64)
        if value:
            return value


@dataclass(frozen=True)
class HandoffPayload:
    """One request's prompt state after prefill, plus what decode needs to continue it.

    ``fields`` holds the tensors by name (see ``common.handoff.manifest``):
      kv          [num_full_layers, 2, num_prompt_pages, page_size, kv_heads, head_dim] model dtype;
                  page aligned, the tail of the last page zero-padded
      conv_state  [num_gdn_layers, conv_dim, conv_window] model dtype
      ssm_state   [num_gdn_layers, HV, V, K] float32 (layout.state_layout)
      and, only when present, dflash_context, logprobs, top_k (shape declared by the tensor).
    ``first_logprobs``: the first token's log-probabilities, when ``spec.sampling.logprobs`` asks.
    """

    handoff_id: int
    fingerprint: str
    layout: LayoutDescriptor
    spec: RequestSpec
    first_token: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    first_logprobs: TokenLogprobs | None = None

    @property
    def prompt_len(self) -> int:
        return self.spec.prompt_len

    def manifest(self) -> dict[str, FieldSpec]:
        """dtype and shape of every field present."""
        return {name: FieldSpec.of(t) for name, t in self.fields.items()}

    def validate(self) -> None:
        """Raise ``HandoffError`` (INVALID_ARGUMENT) if the fields do not fit the layout."""
        validate_manifest(self.layout, self.prompt_len, self.manifest())
