"""The target's hidden states at the draft's ``target_layer_ids``, captured by the project's own
model: one EXTEND forward of a batch of whole sequences from empty caches, exactly the prefill
that feeds a draft's context at inference (``ModelOutput.aux_hidden_states``)."""

from __future__ import annotations

import torch

from common.engine.llm_engine import CacheConfig, make_pools
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.qwen3_5 import HybridForCausalLM

PAGE_SIZE = 16


class HiddenCapture:
    """Runs ``target`` on batches of up to ``max_sequences`` sequences of up to ``seq_len``
    tokens and returns the captured layers' outputs, concatenated in ``layer_ids`` order.

    It turns capture on for ``layer_ids`` on the target (as a speculating engine does).
    """

    def __init__(self, target: HybridForCausalLM, layer_ids, *, max_sequences: int,
                 seq_len: int, device: torch.device | str) -> None:
        if max_sequences < 1 or seq_len < 1:
            raise ValueError("max_sequences and seq_len must be at least 1")
        self.target, self.device = target, torch.device(device)
        target.set_dflash_layers_to_capture(layer_ids)
        pages = -(-seq_len // PAGE_SIZE)
        self.kv_pool, self.state_pool = make_pools(
            target, CacheConfig(page_size=PAGE_SIZE, num_pages=1 + max_sequences * pages,
                                num_slots=1 + max_sequences), self.device)
        self.max_sequences, self.seq_len = max_sequences, seq_len

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` [S, T] -> [S, T, K*H] in the target's dtype (a plain tensor, usable in
        autograd outside inference mode)."""
        s, t = tokens.shape
        if s > self.max_sequences or t > self.seq_len:
            raise ValueError(f"a capture batch holds at most {self.max_sequences} x "
                             f"{self.seq_len} tokens, got {s} x {t}")
        pools = self.kv_pool, self.state_pool
        pages = [self.kv_pool.allocator.allocate(self.kv_pool.pages_for(t)) for _ in range(s)]
        slots = [self.state_pool.allocate() for _ in range(s)]  # zeroed: fresh sequences
        try:
            batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=tokens.tolist(),
                                       prefix_lens=[0] * s, page_ids=pages,
                                       page_size=PAGE_SIZE, state_slots=slots,
                                       device=self.device)
            out = self.target(batch, kv_pool=pools[0], state_pool=pools[1])
        finally:
            for p in pages:
                self.kv_pool.allocator.free(p)
            for slot in slots:
                self.state_pool.free(slot)
        return out.aux_hidden_states.view(s, t, -1).clone()
