"""GDN state slots: the short-conv window and the recurrent state of every GDN layer, plus the
scratch that a speculative VERIFY forward records so that an accepted prefix can be committed."""

from __future__ import annotations

import torch

from common.cache.allocator import IndexAllocator

# Recurrent state per slot is [HV, V, K] (K-last, the FlashInfer / SGLang layout). The reference
# ops use the K-major [HV, K, V] of transformers and fla; convert with .transpose(-1, -2).
STATE_LAYOUT = "hv_v_k"


class VerifyBuffers:
    """Per GDN layer and batch row, the inputs of up to ``tokens`` verified tokens (replay scheme).

    A VERIFY forward leaves the committed state untouched and stores, for token ``i`` of batch
    row ``r``: ``qkv[layer, r, i]`` ``[conv_dim]`` (the pre-conv ``in_proj_qkv`` row) and
    ``a``/``b`` ``[layer, r, i]`` ``[HV]`` (the raw gate projections), all in the model dtype,
    which is exactly what the forward used. Committing ``j`` tokens re-runs the conv and the delta
    rule over rows ``0..j-1`` from the untouched state, so the result is the state that EXTEND of
    those ``j`` tokens gives. Rows are batch rows (not state slots): a commit must use the batch
    of the latest VERIFY, and a second VERIFY before the commit overwrites the first.
    """

    def __init__(self, *, num_layers: int, rows: int, tokens: int, conv_dim: int,
                 num_value_heads: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if rows < 1 or tokens < 1:
            raise ValueError(f"verify buffers need rows >= 1 and tokens >= 1, got {rows}, {tokens}")
        self.rows, self.tokens = rows, tokens
        self.qkv = torch.zeros(num_layers, rows * tokens, conv_dim, dtype=dtype, device=device)
        self.a = torch.zeros(num_layers, rows * tokens, num_value_heads, dtype=dtype,
                             device=device)
        self.b = torch.zeros_like(self.a)
        self.pending = None  # the ForwardBatch whose inputs the buffers hold, until committed
        self._index: torch.Tensor | None = None  # [T] buffer row of each token of `pending`
        self._uniform: tuple[int, int] | None = None  # (rows, length) when all rows have one

    @staticmethod
    def bytes_per_row(*, num_layers: int, tokens: int, conv_dim: int, num_value_heads: int,
                      dtype: torch.dtype) -> int:
        """Extra bytes one running request costs: ``L_gdn * k * (conv_dim + 2*HV) * dtype``."""
        size = torch.empty((), dtype=dtype).element_size()
        return num_layers * tokens * (conv_dim + 2 * num_value_heads) * size

    def fits(self, batch) -> bool:
        return batch.num_requests <= self.rows and max(batch.extend_lens) <= self.tokens

    def begin(self, batch) -> None:
        """Start recording ``batch`` (a VERIFY ForwardBatch); forgets an uncommitted one."""
        if not self.fits(batch):
            raise ValueError(
                f"verify batch of {batch.num_requests} requests x {max(batch.extend_lens)} tokens "
                f"does not fit buffers of {self.rows} rows x {self.tokens} tokens")
        lens = batch.extend_lens
        if min(lens) == max(lens):
            # every row has one length (always so for DFLASH): a strided copy, no index tensor
            self._index, self._uniform = None, (len(lens), lens[0])
        else:
            index = [r * self.tokens + i for r, n in enumerate(lens) for i in range(n)]
            self._index = torch.tensor(index, dtype=torch.int64, device=self.qkv.device)
            self._uniform = None
        self.pending = batch

    def store(self, layer: int, *, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Record one GDN layer's inputs for the batch given to :meth:`begin`.

        Args:
            layer: pool layer index. qkv: [T, conv_dim] pre-conv rows. a, b: [T, HV].
        """
        for buffer, value in ((self.qkv, qkv), (self.a, a), (self.b, b)):
            if self._uniform is None:
                buffer[layer, self._index] = value.to(buffer.dtype)
            else:
                rows, length = self._uniform
                dst = buffer[layer, :rows * self.tokens].view(rows, self.tokens, -1)[:, :length]
                dst.copy_(value.view(rows, length, -1))

    def accepted_lengths(self, batch, accepted_lens: list[int] | torch.Tensor) -> torch.Tensor:
        """``accepted_lens`` for the pending VERIFY batch, as an int32 tensor on the buffers'
        device (one small copy for all layers of the commit).

        A tensor already on the buffers' device is taken as it is, unread: lengths computed on
        the GPU (greedy acceptance) must not be waited for. Host lengths are checked.

        Raises ValueError when ``batch`` is not the pending VERIFY batch, the count is wrong, or
        a host length is outside ``1..extend_lens[r]``.
        """
        if self.pending is None:
            raise ValueError("commit without a pending VERIFY forward (already committed, or "
                             "no VERIFY ran since the buffers were made)")
        if batch is not self.pending:
            raise ValueError("commit must be given the ForwardBatch of the latest VERIFY forward")
        if len(accepted_lens) != batch.num_requests:
            raise ValueError(f"accepted_lens has {len(accepted_lens)} entries for "
                             f"{batch.num_requests} requests")
        if torch.is_tensor(accepted_lens) and accepted_lens.device == self.qkv.device:
            return accepted_lens.to(torch.int32)
        if torch.is_tensor(accepted_lens):
            accepted_lens = accepted_lens.tolist()
        for r, (j, k) in enumerate(zip(accepted_lens, batch.extend_lens)):
            if not 1 <= j <= k:
                raise ValueError(f"request {r}: accepted length {j} is outside 1..{k} (the "
                                 "first verified token is always kept)")
        lens = torch.tensor(accepted_lens, dtype=torch.int32)
        if self.qkv.is_cuda:
            lens = lens.pin_memory()
        return lens.to(self.qkv.device, non_blocking=True)

    def finish(self) -> None:
        self.pending, self._index, self._uniform = None, None, None


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
        self.verify: VerifyBuffers | None = None  # made by reserve_verify or the first VERIFY

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

    # speculative verification
    def reserve_verify(self, rows: int, tokens: int) -> VerifyBuffers:
        """Make the verify buffers hold at least ``rows`` requests x ``tokens`` tokens.

        Call once at start-up with the largest verify batch (running requests x block size) so
        the memory is taken up front; a VERIFY batch that does not fit grows them (reallocates).
        """
        v = self.verify
        if v is not None and v.rows >= rows and v.tokens >= tokens:
            return v
        if v is not None:
            rows, tokens = max(rows, v.rows), max(tokens, v.tokens)
        self.verify = VerifyBuffers(
            num_layers=len(self.layer_ids), rows=rows, tokens=tokens,
            conv_dim=self.conv.shape[2], num_value_heads=self.ssm.shape[2],
            dtype=self.conv.dtype, device=self.conv.device)
        return self.verify

    def begin_verify(self, batch) -> VerifyBuffers:
        """Verify buffers that record ``batch`` (grown if needed)."""
        buffers = self.reserve_verify(batch.num_requests, max(batch.extend_lens))
        buffers.begin(batch)
        return buffers

    def verify_bytes_per_row(self, tokens: int) -> int:
        """Extra bytes per running request for verify blocks of ``tokens`` tokens."""
        return VerifyBuffers.bytes_per_row(
            num_layers=len(self.layer_ids), tokens=tokens, conv_dim=self.conv.shape[2],
            num_value_heads=self.ssm.shape[2], dtype=self.conv.dtype)
