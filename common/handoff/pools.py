"""Between a worker's pools and the handoff fields: gather on the prefill side, scatter on decode.

Payload layouts (``common/handoff/payload.py``): ``kv [L, 2, pages, page, kv_heads, head_dim]``,
``conv_state [L_gdn, conv_dim, W-1]``, ``ssm_state [L_gdn, HV, V, K]``. The KV pool keeps K and
V inside each page (``[L, pages, 2, ...]``), so the two differ by one transpose.
"""

from __future__ import annotations

import torch

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool


def gather_prompt_state(kv_pool: KVPool, state_pool: GDNStatePool, page_ids: list[int],
                        slot: int, prompt_len: int) -> dict[str, torch.Tensor]:
    """Copy one request's prompt KV and GDN state out of the pools (to the CPU)."""
    num_pages = kv_pool.pages_for(prompt_len)
    pages = torch.tensor(page_ids[:num_pages], device=kv_pool.kv.device)
    kv = kv_pool.kv[:, pages].transpose(1, 2).contiguous()  # [L, 2, pages, page, h, d]
    tail = num_pages * kv_pool.page_size - prompt_len
    if tail:
        # the tail of the last page holds stale bytes from earlier owners: send zeros instead
        kv[:, :, -1, kv_pool.page_size - tail:] = 0
    return {
        "kv": kv.cpu(),
        "conv_state": state_pool.conv[:, slot].cpu().contiguous(),
        "ssm_state": state_pool.ssm[:, slot].cpu().contiguous(),
    }


def scatter_prompt_state(kv_pool: KVPool, state_pool: GDNStatePool, page_ids: list[int],
                         slot: int, fields: dict[str, torch.Tensor]) -> None:
    """Write received prompt KV and GDN state into the request's pages and slot."""
    kv = fields["kv"]
    num_pages = kv.shape[2]
    if num_pages > len(page_ids):
        raise ValueError(f"payload has {num_pages} KV pages, the request owns {len(page_ids)}")
    device = kv_pool.kv.device
    pages = torch.tensor(page_ids[:num_pages], device=device)
    kv_pool.kv[:, pages] = kv.to(device).transpose(1, 2)
    state_pool.conv[:, slot] = fields["conv_state"].to(device)
    state_pool.ssm[:, slot] = fields["ssm_state"].to(device)
