"""CUDA-graph replay of a greedy DFLASH step's tail: acceptance and the GDN commit.

After the draft graph and the verify graph of batch size ``bs`` have run, what is left of a
greedy step is fixed-shape device work on fixed buffers: the longest prefix of each row's drafts
(the draft graph's output) that the target's argmax (over the verify graph's logits) agrees
with, the bonus token after it, and the replay of the accepted tokens into each row's GDN slot
(the verify batch's state slots). Launched one by one, those are about a dozen small kernels and
the commit's host checks, a third of a batch-1 step's host time on the H200
(``docs/training.md``); one graph per batch size replays them in one launch.

Padding rows sit in the scratch state slot 0 (``common/engine/cuda_graph.py``) and commit one
token, as the uncaptured path pads them; real rows never hold slot 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.cache.state_pool import GDNStatePool
from common.engine.acceptance import greedy_match
from common.engine.cuda_graph import capture_graphs
from common.model.forward_batch import ForwardBatch

# (bs) -> the full padded drafts [bs, B-1], verify logits [bs * B, V] and verify batch that the
# draft and verify runners of batch size bs read and write
StepBuffers = Callable[[int], tuple[torch.Tensor, torch.Tensor, ForwardBatch]]
# (batch, accepted lengths on the device) -> None: the target's commit of a verify batch
Commit = Callable[[ForwardBatch, torch.Tensor], None]


class GreedyCommitGraphs:
    """Greedy acceptance and commit of a verify batch, from one graph per batch size.

    Args:
        buffers: the draft and verify runners' buffers of a batch size (see ``StepBuffers``);
            with ``capture`` they must be the captured graphs' own outputs.
        commit: the target's commit (``HybridForCausalLM.commit_verified``).
        pad: ``(bs) -> None`` makes every row of the verify batch of size bs padding, before
            the warm-up runs of a capture (they then commit the scratch slot only).
        capture: False runs the same padded computation eagerly (CPU tests).
    """

    def __init__(self, *, batch_sizes: Sequence[int], block_size: int, state_pool: GDNStatePool,
                 buffers: StepBuffers, commit: Commit, pad: Callable[[int], None],
                 capture: bool = True) -> None:
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.block_size, self.state_pool = block_size, state_pool
        self.buffers, self.commit, self.pad = buffers, commit, pad
        self.capture_graphs = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.captured = not capture

    def serves(self, batch: ForwardBatch) -> bool:
        return self.captured and batch.num_requests in self.batch_sizes

    def _accept_and_commit(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        drafts, logits, batch = self.buffers(bs)
        matched = greedy_match(drafts, logits.view(bs, self.block_size, -1))  # [2, bs]
        lengths = torch.where(batch.state_slots > 0, matched[0] + 1, 1)
        self.commit(batch, lengths)
        return matched, lengths

    def capture(self, progress: bool = True) -> None:
        """Capture after the draft and verify graphs (their outputs are this graph's inputs)."""
        if self.captured:
            return

        def forward(bs: int) -> tuple[torch.Tensor, torch.Tensor]:
            # the commit checks that it follows its verify; a replay starts from the verify
            # graph's replay, which records the batch (GraphRunner.run)
            self.state_pool.begin_verify(self.buffers(bs)[2])
            return self._accept_and_commit(bs)

        self.graphs, self.outputs = capture_graphs(
            self.batch_sizes, prepare=self.pad, forward=forward,
            label="greedy commit graphs", progress=progress)
        self.captured = True

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Accept and commit ``batch`` (the padded batch of the verify just run): returns
        :func:`greedy_match`'s ``[2, bs]`` and the committed lengths ``[bs]`` (one for padding
        rows) for every row, padding included, on the device.

        Raises ValueError when ``batch`` is not the verify batch awaiting its commit.
        """
        verify = self.state_pool.verify
        if verify is None or verify.pending is not batch:
            raise ValueError("a greedy commit must follow the verify of its batch")
        bs = batch.num_requests
        if not self.capture_graphs:
            return self._accept_and_commit(bs)
        self.graphs[bs].replay()
        verify.finish()  # what the captured commit did on the host at capture time
        return self.outputs[bs]
