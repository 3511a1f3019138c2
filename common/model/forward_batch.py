"""What one model forward computes: the new tokens of N requests packed into one sequence.

The model reads cached context (KV pages, GDN state slots) through the indices here and writes
the new tokens' KV and the updated GDN state back, so a batch can mix fresh prompts, continued
prompts (chunked prefill) and decode steps without the model knowing which is which.

VERIFY (speculative verification) uses the EXTEND indices but leaves the committed GDN state
alone: the GDN layers record their per-token inputs in the state pool's verify buffers, and
``HybridForCausalLM.commit_verified`` later folds any accepted prefix into the state
(docs/speculative.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from common.cache.kv_pool import page_table


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # any number of new tokens per request, optionally continuing cached state
    DECODE = "decode"  # exactly one new token per request
    # k new tokens per request, computed like EXTEND (KV of all k is written), but the GDN
    # state slots are only read: any prefix of the k tokens can be committed afterwards
    VERIFY = "verify"


class PlannedAttention(Protocol):
    """Paged attention whose indices were prepared once for a whole forward (and, for CUDA
    graphs, live in fixed buffers): every full-attention layer calls :meth:`run`."""

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        ...


@dataclass
class ForwardBatch:
    """Indices of one forward. Build with :meth:`build`; tensors live on the model's device.

    Attributes:
        mode: EXTEND, DECODE or VERIFY.
        input_ids: [T] new tokens of all requests, request after request.
        positions: [T] absolute position of each new token.
        prefix_lens: per request, tokens already in the KV cache / folded into the GDN state.
        extend_lens: per request, new tokens in this forward.
        page_table: [N, max_pages] int32 page ids covering positions 0..prefix+extend-1.
        out_cache_loc: [T] int64 flat KV slot (page * page_size + offset) of each new token.
        state_slots: [N] int64 GDN state slot of each request.
        logits_positions: [M] int64 indices into the T tokens whose logits are returned
            (every token for VERIFY).
        cu_seqlens: [N+1] int64 offsets of each request's new tokens; built on the CPU when not
            given (a CUDA-graph batch passes a fixed device tensor instead).
        attention: planned attention for this batch, or None to call the kernel set's
            ``paged_attention`` with the batch's page table and lengths.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor
    state_slots: torch.Tensor
    logits_positions: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    attention: PlannedAttention | None = None

    def __post_init__(self) -> None:
        if self.cu_seqlens is None:
            # built once here: every GDN layer of the forward reads it
            self.cu_seqlens = torch.zeros(self.num_requests + 1, dtype=torch.int64)
            self.cu_seqlens[1:] = torch.cumsum(torch.tensor(self.extend_lens, dtype=torch.int64), 0)

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @classmethod
    def build(
        cls,
        *,
        mode: ForwardMode,
        token_ids: list[list[int]],
        prefix_lens: list[int],
        page_ids: list[list[int]],
        page_size: int,
        state_slots: list[int],
        return_all_logits: bool = False,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Pack per-request new tokens into a batch.

        Args:
            token_ids: per request, the new tokens of this forward.
            prefix_lens: per request, tokens already cached.
            page_ids: per request, the pages holding positions 0..prefix+len(new)-1, in order.
            state_slots: per request, its GDN state slot.
            return_all_logits: logits for every new token, else only each request's last.
                VERIFY always returns logits for every token: acceptance needs them all.
        """
        n = len(token_ids)
        if not (len(prefix_lens) == len(page_ids) == len(state_slots) == n) or n == 0:
            raise ValueError("token_ids, prefix_lens, page_ids and state_slots must be non-empty "
                             "and of equal length")
        extend_lens = [len(t) for t in token_ids]
        if min(extend_lens) == 0:
            raise ValueError("every request needs at least one new token")
        if mode == ForwardMode.DECODE and max(extend_lens) != 1:
            raise ValueError("DECODE takes exactly one token per request")
        for r, (p, e, pages) in enumerate(zip(prefix_lens, extend_lens, page_ids)):
            if len(pages) * page_size < p + e:
                raise ValueError(f"request {r}: {len(pages)} pages of {page_size} cannot hold "
                                 f"{p + e} tokens")
        flat_ids, positions, locs, last = [], [], [], []
        for p, toks, pages in zip(prefix_lens, token_ids, page_ids):
            flat_ids.extend(toks)
            for pos in range(p, p + len(toks)):
                positions.append(pos)
                locs.append(pages[pos // page_size] * page_size + pos % page_size)
            last.append(len(flat_ids) - 1)
        every = return_all_logits or mode == ForwardMode.VERIFY
        logits_positions = list(range(len(flat_ids))) if every else last
        as_long = dict(dtype=torch.int64, device=device)
        return cls(
            mode=mode,
            input_ids=torch.tensor(flat_ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            prefix_lens=list(prefix_lens),
            extend_lens=extend_lens,
            page_table=page_table(page_ids, device),
            out_cache_loc=torch.tensor(locs, **as_long),
            state_slots=torch.tensor(state_slots, **as_long),
            logits_positions=torch.tensor(logits_positions, **as_long),
        )
