"""GDN state slots: the short-conv window and the recurrent state of every GDN layer."""

from __future__ import annotations

import torch

from common.cache.allocator import IndexAllocator

# Recurrent state per slot is [HV, V, K] (K-last, the FlashInfer / SGLang layout). The reference
# ops use the K-major [HV, K, V] of transformers and fla; convert with .transpose(-1, -2).
STATE_LAYOUT = "hv_v_k"


class GDNStatePool:
    """Per slot and GDN layer: ``conv [conv_dim, W-1]`` (model dtype, last W-1 pre-conv inputs,
    oldest first) and ``ssm [HV, V, K]`` (fp32). Slot 0 is scratch.
    """

    def __init__(self, *, layer_ids: tuple[int, ...], num_slots: int, conv_dim: int,
                 conv_window: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_dtype: torch.dtype,
                 ssm_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.layer_ids = tuple(layer_ids)
        self._index = {lid: j for j, lid in enumerate(self.layer_ids)}
        self.num_slots = num_slots
        num_layers = len(self.layer_ids)
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_window, dtype=conv_dtype,
                                device=device)
        self.ssm = torch.zeros(num_layers, num_slots, num_value_heads, value_head_dim,
                               key_head_dim, dtype=ssm_dtype, device=device)
        self.allocator = IndexAllocator(num_slots, name="state slots")

    def layer_index(self, layer_id: int) -> int:
        return self._index[layer_id]

    def allocate(self) -> int:
        """A fresh slot with zeroed state (a new prompt starts from zero state)."""
        (slot,) = self.allocator.allocate(1)
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.allocator.free([slot])

    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.ssm[:, 0].numel() * self.ssm.element_size())
