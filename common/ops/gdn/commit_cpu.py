"""Commit of a speculative verify into the GDN state pool in plain torch, fast on the CPU: the
accepted prefix of every request replayed into its slot, layer by layer
(``commit_reference.py`` defines it)."""

from __future__ import annotations

import torch

from common.ops.gdn.commit_reference import accepted_lengths, check_commit
from common.ops.gdn.replay_cpu import replay

__all__ = ["gdn_commit_in_place"]


def gdn_commit_in_place(
    *,
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    block: int,
    accepted: torch.Tensor,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    num_v_heads: int,
    scale: float | None = None,
) -> None:
    """Fold the first ``accepted[n]`` recorded tokens of request n into pool row ``slots[n]``
    of every layer; the contract of ``commit_reference.gdn_commit_in_place`` (same arguments,
    same pools to fp32 rounding), through the batched chunked walk of ``replay_cpu`` without
    its outputs, on the pool rows in place. The accepted lengths and slots are read on the
    host.

    Args:
        qkv: [L, rows, conv_dim] recorded pre-conv rows; token i of request n is row
            ``n * block + i``.
        a, b: [L, rows, HV] recorded raw gate projections.
        block: recorded rows per request.
        accepted: integer [N] tokens to commit per request, each in ``1..block``.
        conv_pool: [L, S, conv_dim, W-1]; ssm_pool: [L, S, HV, V, K] K-last; both updated in
            place (rows not named in ``slots`` are left untouched).
        conv_weight: [L, conv_dim, W]. A_log, dt_bias: [L, HV].
        slots: integer [N] pool rows; distinct, except that padding rows may all name scratch
            slot 0 (what lands there is unspecified).
        scale: query scale of the rule (unused by the state).
    """
    layers = check_commit(qkv=qkv, a=a, b=b, block=block, accepted=accepted,
                          conv_pool=conv_pool, conv_weight=conv_weight, ssm_pool=ssm_pool,
                          slots=slots, A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads,
                          num_v_heads=num_v_heads)[0]
    lens = accepted_lengths(accepted, block)
    n, length = len(lens), max(lens)
    rows = slots.tolist()
    index = slots.to(device=conv_pool.device, dtype=torch.long)
    dt = torch.float64 if qkv.dtype == torch.float64 else torch.float32

    def recorded(x: torch.Tensor, layer: int) -> torch.Tensor:
        # already the padded block the walk takes: request n's token i is row n * block + i
        return x[layer, :n * block].reshape(n, block, x.shape[-1])[:, :length]

    for layer in range(layers):
        pool = ssm_pool[layer]
        # stepped where they lie in the pool; a pool in another dtype than the compute is
        # stepped in converted copies, written back after
        states = [pool[r] if pool.dtype == dt else pool[r].to(dt) for r in rows]
        _, new_conv = replay(qkv=recorded(qkv, layer), a=recorded(a, layer),
                             b=recorded(b, layer), lens=lens,
                             conv_state=conv_pool[layer].index_select(0, index),
                             conv_weight=conv_weight[layer], states=states, A_log=A_log[layer],
                             dt_bias=dt_bias[layer], num_k_heads=num_k_heads,
                             num_v_heads=num_v_heads, scale=scale, outputs=False)
        conv_pool[layer].index_copy_(0, index, new_conv.to(conv_pool.dtype))
        if pool.dtype != dt:
            for r, s in zip(rows, states):
                pool[r].copy_(s)
