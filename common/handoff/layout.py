"""What the handoff tensors look like, and who may exchange them.

``LayoutDescriptor`` mirrors ``flashsplit.v1.LayoutDescriptor``: two workers may exchange a payload
only when their descriptors are equal and their model fingerprints are equal. A mismatch is found
at the header, before any byte is reserved, and answered with FAILED_PRECONDITION.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.config import ModelConfig
from common.handoff.errors import HandoffError

if TYPE_CHECKING:  # torch is imported where dtypes are resolved: the router never does
    import torch

# Order of the recurrent state's dims per GDN layer, by name (docs/architecture.md "State layouts").
STATE_LAYOUTS = ("hv_v_k", "hv_k_v")
DEFAULT_STATE_LAYOUT = "hv_v_k"


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical torch dtype name ("bfloat16", "float32", ...) for a dtype or any alias of one."""
    return str(to_dtype(dtype)).removeprefix("torch.")


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype named by ``dtype`` ("bfloat16", "torch.float16", "float", ...)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype name")
    return value


@dataclass(frozen=True)
class LayoutDescriptor:
    """Shapes, dtypes and orders of the payload tensors, as both workers hold them.

    Layer ids are model layer indices; ``full_attention_layers`` gives dim 0 of ``kv``, and
    ``gdn_layers`` dim 0 of ``conv_state`` and ``ssm_state``.
    """

    dtype: str                      # kv and conv_state
    page_size: int
    full_attention_layers: tuple[int, ...]
    gdn_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    conv_dim: int
    conv_window: int                # conv kernel width - 1
    num_key_heads: int
    num_value_heads: int            # HV
    key_head_dim: int               # K
    value_head_dim: int             # V
    state_layout: str = DEFAULT_STATE_LAYOUT
    ssm_dtype: str = "float32"

    @classmethod
    def from_model(cls, config: ModelConfig, page_size: int, dtype: torch.dtype | str, *,
                   state_layout: str = DEFAULT_STATE_LAYOUT,
                   ssm_dtype: torch.dtype | str = "float32") -> "LayoutDescriptor":
        """The layout of a worker serving ``config`` with ``page_size``-token pages in ``dtype``."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if state_layout not in STATE_LAYOUTS:
            raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
        return cls(
            dtype=dtype_name(dtype),
            page_size=page_size,
            full_attention_layers=tuple(config.full_attention_layers),
            gdn_layers=tuple(config.linear_attention_layers),
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            conv_dim=config.conv_dim,
            conv_window=config.linear_conv_kernel_dim - 1,
            num_key_heads=config.linear_num_key_heads,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
            state_layout=state_layout,
            ssm_dtype=dtype_name(ssm_dtype),
        )

    def num_pages(self, prompt_len: int) -> int:
        """KV pages that hold ``prompt_len`` tokens."""
        return -(-prompt_len // self.page_size)

    def field_shape(self, field: str, prompt_len: int) -> tuple[int, ...] | None:
        """Shape the layout fixes for ``field`` of a ``prompt_len``-token prompt; None if free."""
        if field == "kv":
            return (len(self.full_attention_layers), 2, self.num_pages(prompt_len), self.page_size,
                    self.kv_heads, self.head_dim)
        if field == "conv_state":
            return (len(self.gdn_layers), self.conv_dim, self.conv_window)
        if field == "ssm_state":
            hv, k, v = self.num_value_heads, self.key_head_dim, self.value_head_dim
            per_layer = (hv, v, k) if self.state_layout == "hv_v_k" else (hv, k, v)
            return (len(self.gdn_layers), *per_layer)
        return None

    def field_dtype(self, field: str) -> str | None:
        """The dtype name the layout fixes for ``field``; None if free."""
        if field in ("kv", "conv_state"):
            return self.dtype
        if field == "ssm_state":
            return self.ssm_dtype
        return None

    def check_compatible(self, other: "LayoutDescriptor") -> None:
        """Raise FAILED_PRECONDITION naming every attribute where ``other`` (the peer's) differs."""
        diffs = [f"{f.name}: ours {getattr(self, f.name)!r}, theirs {getattr(other, f.name)!r}"
                 for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise HandoffError("FAILED_PRECONDITION", "layout mismatch: " + "; ".join(diffs))


def model_fingerprint(config: ModelConfig, weights_identity: str) -> str:
    """sha256 over the architecture (every field that takes part in ``ModelConfig`` equality) and
    ``weights_identity`` (whatever names the weights: a checkpoint's index hash, "random:<seed>").

    Two workers with equal fingerprints compute the same function, so one's state is valid on the
    other. The raw config dict is left out: its extra keys (versions, comments) change nothing.
    """
    arch = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.compare}
    canonical = json.dumps({"config": arch, "weights": weights_identity}, sort_keys=True,
                           separators=(",", ":"), default=list)
    return hashlib.sha256(canonical.encode()).hexdigest()
