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

from common.ops.conv1d.reference import causal_conv1d_prefill
from common.ops.gdn.reference import gdn_gating, recurrent_gated_delta_rule

__all__ = ["gdn_commit_in_place", "check_commit"]


def check_commit(*, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int,
                 accepted: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
                 ssm_pool: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, num_k_heads: int, num_v_heads: int
                 ) -> tuple[int, int, int, int, int]:
    """Shape rules of :func:`gdn_commit_in_place`, from metadata only; returns (L, N, K, V, W)."""
    if qkv.dim() != 3:
        raise ValueError(f"qkv must be [L, rows, conv_dim], got {tuple(qkv.shape)}")
    layers, rows, conv_dim = qkv.shape
    hv = num_v_heads
    if a.shape != (layers, rows, hv) or b.shape != (layers, rows, hv):
        raise ValueError(f"a and b must be [{layers}, {rows}, {hv}], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if ssm_pool.dim() != 5 or ssm_pool.shape[0] != layers or ssm_pool.shape[2] != hv:
        raise ValueError(f"ssm_pool must be [{layers}, S, {hv}, V, K], got {tuple(ssm_pool.shape)}")
    dv, dk = ssm_pool.shape[3], ssm_pool.shape[4]
    if num_k_heads < 1 or hv % num_k_heads != 0:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({num_k_heads})")
    if conv_dim != 2 * num_k_heads * dk + hv * dv:
        raise ValueError(f"qkv has {conv_dim} channels, expected 2*{num_k_heads}*{dk} + {hv}*{dv}")
    if conv_weight.dim() != 3 or conv_weight.shape[:2] != (layers, conv_dim):
        raise ValueError(f"conv_weight must be [{layers}, {conv_dim}, W], got "
                         f"{tuple(conv_weight.shape)}")
    width = conv_weight.shape[2]
    want = (layers, ssm_pool.shape[1], conv_dim, width - 1)
    if conv_pool.shape != want:
        raise ValueError(f"conv_pool must be {list(want)}, got {tuple(conv_pool.shape)}")
    n = slots.numel()
    if slots.dim() != 1 or slots.is_floating_point():
        raise ValueError(f"slots must be an integer tensor [N], got {slots.dtype} {tuple(slots.shape)}")
    if accepted.shape != (n,) or accepted.is_floating_point():
        raise ValueError(f"accepted must be an integer tensor [{n}], got {accepted.dtype} "
                         f"{tuple(accepted.shape)}")
    if block < 1 or n * block > rows:
        raise ValueError(f"{n} requests x block {block} exceed the {rows} recorded rows")
    if A_log.shape != (layers, hv) or dt_bias.shape != (layers, hv):
        raise ValueError(f"A_log and dt_bias must be [{layers}, {hv}], got {tuple(A_log.shape)} "
                         f"and {tuple(dt_bias.shape)}")
    return layers, n, dk, dv, width


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

    Exactly what EXTEND of those tokens does to the slot: silu causal conv from the slot's window
    (``causal_conv1d_prefill``), gates (``gdn_gating``), then the l2-normalised gated delta rule
    from the slot's state (``recurrent_gated_delta_rule``); the conv window and state are written
    back. The token outputs are not needed and not computed.

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
    layers, n, dk, dv, _ = check_commit(qkv=qkv, a=a, b=b, block=block, accepted=accepted,
                                conv_pool=conv_pool, conv_weight=conv_weight, ssm_pool=ssm_pool,
                                slots=slots, A_log=A_log, dt_bias=dt_bias,
                                num_k_heads=num_k_heads, num_v_heads=num_v_heads)
    lens = [int(j) for j in accepted.tolist()]
    if any(not 1 <= j <= block for j in lens):
        raise ValueError(f"accepted lengths {lens} must each be in 1..{block}")
    device = qkv.device
    index = torch.tensor([r * block + i for r, j in enumerate(lens) for i in range(j)],
                         dtype=torch.long, device=device)
    bounds = [0]
    for j in lens:
        bounds.append(bounds[-1] + j)
    cu = torch.tensor(bounds, dtype=torch.long, device=device)
    rows = slots.to(device=conv_pool.device, dtype=torch.long)
    key_dim = num_k_heads * dk
    t = index.numel()
    for layer in range(layers):
        x, new_conv = causal_conv1d_prefill(
            x=qkv[layer, index], weight=conv_weight[layer], cu_seqlens=cu,
            initial_state=conv_pool[layer, rows], activation="silu")
        q = x[:, :key_dim].reshape(t, num_k_heads, dk)
        k = x[:, key_dim:2 * key_dim].reshape(t, num_k_heads, dk)
        v = x[:, 2 * key_dim:].reshape(t, num_v_heads, dv)
        g, beta = gdn_gating(A_log=A_log[layer], a=a[layer, index], dt_bias=dt_bias[layer],
                             b=b[layer, index])
        _, final = recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu,
            initial_state=ssm_pool[layer, rows].transpose(-1, -2), scale=scale,
            use_qk_l2norm=True)
        conv_pool[layer, rows] = new_conv.to(conv_pool.dtype)
        ssm_pool[layer, rows] = final.transpose(-1, -2).to(ssm_pool.dtype)
