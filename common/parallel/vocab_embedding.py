"""The token embedding split by vocabulary rows over a tensor-parallel group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel.group import TensorParallelGroup


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding rows ``vocab`` of the full table.

    Each rank looks up the ids in its rows and writes zeros for the others; the all-reduce then
    adds one real row to zeros, so the result is bit-exact whatever the group size. At world
    size 1 it is the plain ``nn.Embedding`` lookup.
    """

    def __init__(self, vocab: range, hidden: int, dtype: torch.dtype,
                 tp: TensorParallelGroup) -> None:
        super().__init__(len(vocab), hidden, dtype=dtype,
                         _weight=torch.empty(len(vocab), hidden, dtype=dtype))
        self.weight.requires_grad_(False)
        self.vocab_start, self.vocab_stop = vocab.start, vocab.stop
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)
