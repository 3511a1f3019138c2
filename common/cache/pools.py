"""An engine's cache pools: their sizes, and the KV and GDN state pools a model needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int = 1024   # including the scratch page 0
    num_slots: int = 65     # including the scratch slot 0


def make_pools(model, cache: CacheConfig,
               device: torch.device | str) -> tuple[KVPool, GDNStatePool]:
    """The KV pool of ``model``'s full-attention layers and the GDN state pool of its linear
    attention layers, sized by ``cache``, in the model's dtype on ``device``. A tensor-parallel
    rank's pools hold its own heads (``model.shard_plan``); the page and slot ids are the same
    on every rank."""
    c, plan = model.config, model.shard_plan
    kv_pool = KVPool(layer_ids=c.full_attention_layers, num_pages=cache.num_pages,
                     page_size=cache.page_size, num_kv_heads=plan.attention.num_groups,
                     head_dim=c.head_dim, dtype=model.dtype, device=device)
    state_pool = GDNStatePool(
        layer_ids=c.linear_attention_layers, num_slots=cache.num_slots,
        conv_dim=plan.gdn_conv_dim, conv_window=c.linear_conv_kernel_dim - 1,
        num_value_heads=plan.gdn.num_heads,
        key_head_dim=c.linear_key_head_dim, value_head_dim=c.linear_value_head_dim,
        conv_dtype=model.dtype, device=device)
    return kv_pool, state_pool
