"""Between a worker's pools and the handoff fields: gather on the prefill side, scatter on decode.

Payload layouts (``common/handoff/payload.py``): ``kv [L, 2, pages, page, kv_heads, head_dim]``,
``conv_state [L_gdn, conv_dim, W-1]``, ``ssm_state [L_gdn, HV, V, K]``, and for speculative
requests ``dflash_context [L_draft, 2, pages, page, kv_heads, head_dim]`` (the draft's context K/V
of the prompt, docs/speculative.md says why it is sent rather than the captured hidden states).
The pools keep K and V inside each page (``[L, pages, 2, ...]``): one transpose apart.
"""

from __future__ import annotations

import torch

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool
from common.model.dflash import DraftKVPool


def _gather_pages(kv: torch.Tensor, page_ids: list[int], prompt_len: int,
                  page_size: int) -> torch.Tensor:
    """``[L, pages, 2, page, h, d]`` pool -> ``[L, 2, n, page, h, d]`` on the CPU for the prompt."""
    num_pages = -(-prompt_len // page_size)
    pages = torch.tensor(page_ids[:num_pages], device=kv.device)
    out = kv[:, pages].transpose(1, 2).contiguous()
    tail = num_pages * page_size - prompt_len
    if tail:
        # the tail of the last page holds stale bytes from earlier owners: send zeros instead
        out[:, :, -1, page_size - tail:] = 0
    return out.cpu()


def _scatter_pages(kv: torch.Tensor, page_ids: list[int], field: torch.Tensor) -> None:
    num_pages = field.shape[2]
    if num_pages > len(page_ids):
        raise ValueError(f"payload has {num_pages} pages, the request owns {len(page_ids)}")
    pages = torch.tensor(page_ids[:num_pages], device=kv.device)
    kv[:, pages] = field.to(kv.device).transpose(1, 2)


def gather_prompt_state(kv_pool: KVPool, state_pool: GDNStatePool, page_ids: list[int],
                        slot: int, prompt_len: int,
                        draft_pool: DraftKVPool | None = None) -> dict[str, torch.Tensor]:
    """Copy one request's prompt KV and GDN state (and the draft's context K/V of the prompt,
    given ``draft_pool``) out of the pools, to the CPU."""
    fields = {
        "kv": _gather_pages(kv_pool.kv, page_ids, prompt_len, kv_pool.page_size),
        "conv_state": state_pool.conv[:, slot].cpu().contiguous(),
        "ssm_state": state_pool.ssm[:, slot].cpu().contiguous(),
    }
    if draft_pool is not None:
        fields["dflash_context"] = _gather_pages(draft_pool.kv, page_ids, prompt_len,
                                                 kv_pool.page_size)
    return fields


def scatter_prompt_state(kv_pool: KVPool, state_pool: GDNStatePool, page_ids: list[int],
                         slot: int, fields: dict[str, torch.Tensor],
                         draft_pool: DraftKVPool | None = None) -> None:
    """Write received prompt KV and GDN state (and the draft context, given ``draft_pool`` and
    a ``dflash_context`` field) into the request's pages and slot."""
    _scatter_pages(kv_pool.kv, page_ids, fields["kv"])
    device = kv_pool.kv.device
    state_pool.conv[:, slot] = fields["conv_state"].to(device)
    state_pool.ssm[:, slot] = fields["ssm_state"].to(device)
    if draft_pool is not None and "dflash_context" in fields:
        _scatter_pages(draft_pool.kv, page_ids, fields["dflash_context"])
