"""Commit of a speculative verify into the GDN state pool: the accepted prefix, replayed.

A VERIFY forward leaves every GDN slot as it was and records, per token, the pre-conv
``in_proj_qkv`` row and the raw gate projections ``a``, ``b`` (``GDNStatePool.verify``). Once the
accepted length of each request is known, its slot must become the state that EXTEND of exactly
those tokens would have left: conv window and recurrent state. This op is that replay, for
every GDN layer at once (tensors stacked on a leading layer dim, as the pool and the verify
buffers already are), on the pool rows themselves: one call per step, not one per layer.
"""

from __future__ import annotations

import torch

from common.ops.gdn.replay_reference import check_layer, replay

__all__ = ["gdn_commit_in_place", "accepted_lengths", "check_commit"]


def check_commit(*, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int,
                 accepted: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, num_k_heads: int, num_v_heads: int
                 ) -> tuple[int, int, int, int, int]:
    """Shape rules of :func:`gdn_commit_in_place`, from metadata only; returns (L, N, K, V, W)."""
    if qkv.dim() != 3:
        raise ValueError(f"qkv must be [L, rows, conv_dim], got {tuple(qkv.shape)}")
    layers = qkv.shape[0]
    stacked = dict(a=(a, 3), b=(b, 3), conv_pool=(conv_pool, 4), conv_weight=(conv_weight, 3),
                   ssm_pool=(ssm_pool, 5), A_log=(A_log, 2), dt_bias=(dt_bias, 2))
    for name, (t, dims) in stacked.items():
        if t.dim() != dims or t.shape[0] != layers:
            raise ValueError(f"{name} must have {dims} dims, the first the {layers} layers, "
                             f"got {tuple(t.shape)}")
    rows, n, dk, dv, width = check_layer(
        qkv=qkv[0], a=a[0], b=b[0], conv_pool=conv_pool[0], conv_weight=conv_weight[0],
        ssm_pool=ssm_pool[0], slots=slots, A_log=A_log[0], dt_bias=dt_bias[0],
        num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    if accepted.shape != (n,) or accepted.is_floating_point():
        raise ValueError(f"accepted must be an integer tensor [{n}], got {accepted.dtype} "
                         f"{tuple(accepted.shape)}")
    if block < 1 or n * block > rows:
        raise ValueError(f"{n} requests x block {block} exceed the {rows} recorded rows")
    return layers, n, dk, dv, width


def accepted_lengths(accepted: torch.Tensor, block: int) -> list[int]:
    """The tokens to commit per request as ints (read on the host); ValueError unless each is in
    ``1..block``."""
    lens = [int(j) for j in accepted.tolist()]
    if any(not 1 <= j <= block for j in lens):
        raise ValueError(f"accepted lengths {lens} must each be in 1..{block}")
    return lens


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
    """Fold the first ``accepted[n]`` recorded tokens of request n into pool row ``slots[n]`` of
    every layer.

    Exactly what EXTEND of those tokens does to the slot (``replay_reference.replay``: silu causal
    conv from the slot's window, gates, the l2-normalised gated delta rule from the slot's
    state); the conv window and state are written back. The token outputs are not needed (this
    reference computes and drops them; the Triton op does not compute them).

    Every tensor but ``accepted`` and ``slots`` has a leading layer dim L (layer l of each is
    one GDN layer).

    Args:
        qkv: [L, rows, conv_dim] recorded pre-conv rows; token i of request n is row
            ``n * block + i``. Channels are q | k | v (``num_k_heads`` K-dim heads for q and k,
            ``num_v_heads`` V-dim heads for v).
        a, b: [L, rows, HV] recorded raw gate projections.
        block: recorded rows per request (the verify buffers' tokens per row).
        accepted: integer [N] tokens to commit per request, each in ``1..block`` (not checked
            on the host for device tensors).
        conv_pool: [L, S, conv_dim, W-1]; ssm_pool: [L, S, HV, V, K] K-last; both updated in
            place.
        conv_weight: [L, conv_dim, W]. A_log, dt_bias: [L, HV].
        slots: integer [N] pool rows; distinct, except that padding rows may all name scratch
            slot 0 (what lands there is unspecified).
        scale: query scale of the rule (unused by the state; kept for the rule's contract).
    """
    layers = check_commit(qkv=qkv, a=a, b=b, block=block, accepted=accepted,
                          conv_pool=conv_pool, conv_weight=conv_weight, ssm_pool=ssm_pool,
                          slots=slots, A_log=A_log, dt_bias=dt_bias, num_k_heads=num_k_heads,
                          num_v_heads=num_v_heads)[0]
    lens = accepted_lengths(accepted, block)
    device = qkv.device
    index = torch.tensor([r * block + i for r, j in enumerate(lens) for i in range(j)],
                         dtype=torch.long, device=device)
    bounds = [0]
    for j in lens:
        bounds.append(bounds[-1] + j)
    cu = torch.tensor(bounds, dtype=torch.long, device=device)
    rows = slots.to(device=conv_pool.device, dtype=torch.long)
    for layer in range(layers):
        _, new_conv, final = replay(
            mixed_qkv=qkv[layer, index], a=a[layer, index], b=b[layer, index], cu_seqlens=cu,
            conv_state=conv_pool[layer, rows], conv_weight=conv_weight[layer],
            ssm_state=ssm_pool[layer, rows], A_log=A_log[layer], dt_bias=dt_bias[layer],
            num_k_heads=num_k_heads, num_v_heads=num_v_heads, scale=scale)
        conv_pool[layer, rows] = new_conv.to(conv_pool.dtype)
        ssm_pool[layer, rows] = final.to(ssm_pool.dtype)
