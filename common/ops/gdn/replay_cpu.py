"""GDN tokens replayed from given states in plain torch, fast on the CPU: the walk shared by the
CPU verify and commit (``verify_cpu.py``, ``commit_cpu.py``) and, from :func:`walk` on, the CPU
prefill (``prefill_cpu.py``).

The reference (``replay_reference.replay``) convolves request by request and steps the
recurrence token by token, gathering, decaying and scattering every state at every token. Here
the requests' tokens sit in one padded ``[N, L]`` block: the conv is W shifted multiply-adds
over all of them at once (the reference's sum order, so the same conv output), and the delta
rule runs in its chunked (WY) form, batched over requests and heads: a few small matmuls per
64 tokens, one read of each state for all its tokens' products and, where the final state is
wanted, one in-place update, instead of three passes per token. The chunked form is the one
EXTEND runs (``reference.chunk_gated_delta_rule``); it equals the recurrence to fp32 rounding
(gate factors under e**-40 taken as 0: ``decode_cpu.NEGLIGIBLE``).

A padded token has decay 1, write strength 0 and a zero key: it leaves the state exactly as it
was, so padding needs no masking in the rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.gdn._common import sequence_bounds
from common.ops.gdn.decode_cpu import drop_negligible, l2_normalised, per_value_head
from common.ops.gdn.reference import gdn_gating
from common.ops.padded_block import real_tokens

__all__ = ["CHUNK", "replay", "walk", "sequence_lengths"]

# tokens per step of the chunked rule (the reference prefill's): a longer block is walked chunk
# by chunk, its state stepped between chunks
CHUNK = 64

# states the walk reads and steps: one [N, HV, V, K] tensor, or N [HV, V, K] tensors (views
# of pool rows, stepped where they lie)
States = torch.Tensor | list[torch.Tensor]


def sequence_lengths(cu_seqlens: torch.Tensor, rows: int) -> list[int]:
    """Per-sequence lengths from integer offsets [N+1] (read on the host); ValueError unless
    they rise from 0 to ``rows``."""
    bounds = sequence_bounds(cu_seqlens, rows)
    return [e - s for s, e in zip(bounds, bounds[1:])]


def replay(*, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lens: list[int],
           conv_state: torch.Tensor, conv_weight: torch.Tensor, states: States,
           A_log: torch.Tensor, dt_bias: torch.Tensor, num_k_heads: int, num_v_heads: int,
           scale: float | None = None, outputs: bool = True, final_state: bool = True
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Sequences continued from the given states, as ``replay_reference.replay`` computes
    them (shapes checked by the caller).

    Args:
        qkv: [N, L, conv_dim] pre-conv rows (q | k | v), sequence n's tokens first in row n
            (what lies past ``lens[n]`` is ignored). a, b: [N, L, HV] raw gates, likewise.
        lens: the N sequences' lengths, each at most L.
        conv_state: [N, conv_dim, W-1]. conv_weight: [conv_dim, W]. A_log, dt_bias: [HV].
        states: [N, HV, V, K] or N [HV, V, K] states (pool layout) in the compute dtype (fp32;
            fp64 for fp64 rows), stepped in place. Without ``final_state`` they are stepped
            only between chunks (not at all for L <= :data:`CHUNK`).
        scale: query scale (default K**-0.5). outputs: compute the token outputs.

    Returns:
        o [N, L, HV, V] in qkv.dtype (rows past a sequence's length are not its tokens; None
        without ``outputs``) and the new conv state [N, conv_dim, W-1] in qkv.dtype.
    """
    n, length, _ = qkv.shape
    width = conv_weight.shape[1]
    hk, hv = num_k_heads, num_v_heads
    dv, dk = states[0].shape[-2:] if isinstance(states, list) else states.shape[-2:]
    # the reference's dtypes: the conv's from the rows and weight, the rule's from the rows
    conv_dt = torch.float64 if torch.float64 in (qkv.dtype, conv_weight.dtype) else torch.float32
    dt = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    device = qkv.device

    # conv over [W-1 inputs of the window | L tokens] of every sequence at once
    window = torch.cat([conv_state.to(conv_dt).transpose(1, 2), qkv.to(conv_dt)], dim=1)
    w = conv_weight.to(conv_dt)
    x = window[:, :length] * w[:, 0]
    for s in range(1, width):
        x = x + window[:, s:s + length] * w[:, s]
    # rounded to the rows' dtype as the reference's conv output is, before the rule reads it
    x = F.silu(x).to(qkv.dtype).to(dt)  # [N, L, conv_dim]
    # the last W-1 inputs of each sequence (its window's when it is shorter than that)
    ends = torch.tensor(lens, device=device)[:, None] + torch.arange(width - 1, device=device)
    new_conv = window.gather(1, ends[..., None].expand(n, width - 1, window.shape[2]))
    new_conv = new_conv.transpose(1, 2).to(qkv.dtype)
    if length == 0:
        return (qkv.new_empty(n, 0, hv, dv) if outputs else None), new_conv

    key_dim = hk * dk
    qk = l2_normalised(x[..., :2 * key_dim].reshape(n, length, 2, hk, dk), True, dim=-1)
    q = qk[:, :, 0] * (dk ** -0.5 if scale is None else scale)
    k = qk[:, :, 1]
    v = x[..., 2 * key_dim:].reshape(n, length, hv, dv)
    g, beta = gdn_gating(A_log=A_log, a=a.flatten(0, 1), dt_bias=dt_bias, b=b.flatten(0, 1))
    g = g.to(dt).view(n, length, hv)
    beta = drop_negligible(beta.to(dt)).view(n, length, hv)
    pad = ~real_tokens(lens, device) if min(lens) < length else None
    o = walk(q, k, v, g, beta, states, pad=pad, outputs=outputs, final_state=final_state)
    return (None if o is None else o.to(qkv.dtype)), new_conv


def walk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, states: States, *, pad: torch.Tensor | None = None,
         lens: list[int] | None = None, chunk: int = CHUNK, outputs: bool = True,
         final_state: bool = True) -> torch.Tensor | None:
    """The chunked rule over a padded block of N sequences, chunk by chunk (shared with the
    CPU prefill, ``prefill_cpu.py``).

    q, k: [N, L, HK, K] (q scaled, both l2-normalised as the caller wants); v: [N, L, HV, V];
    g, beta: [N, L, HV] log decay and write strength. pad: [N, L], True at padding tokens
    (None: none), which get a zero key, g and beta, so they leave the state as it was.
    states: N states in pool layout, stepped in place (only between chunks without
    ``final_state``). lens: the N lengths when they never rise (longest first): a chunk then
    leaves out the sequences that ended before it instead of walking their padding. Returns
    o [N, L, HV, V] in the compute dtype (rows at padding positions unspecified; None without
    ``outputs``).
    """
    n, length, hv = v.shape[:3]
    if lens is not None and any(b > a for a, b in zip(lens, lens[1:])):
        raise ValueError(f"walk: lens must not rise, got {lens}")
    if pad is not None:
        k = k.masked_fill(pad[..., None, None], 0)
        g = g.masked_fill(pad[..., None], 0)
        beta = beta.masked_fill(pad[..., None], 0)

    # head-major [N*HV, L, D]: every product of a chunk is a matmul batched over (sequence, head)
    def heads(x: torch.Tensor) -> torch.Tensor:
        return per_value_head(x.transpose(1, 2), hv).reshape(n * hv, length, -1)

    q, k, v = heads(q), heads(k), heads(v)
    g, beta = (x.transpose(1, 2).reshape(n * hv, length) for x in (g, beta))
    o = torch.empty(*v.shape, dtype=v.dtype, device=v.device) if outputs else None
    for cs in range(0, length, chunk):
        ce = min(cs + chunk, length)
        live = n if lens is None else sum(1 for x in lens if x > cs)  # a prefix of the rows
        rows = slice(0, live * hv)
        o_chunk = _chunk(q[rows, cs:ce], k[rows, cs:ce], v[rows, cs:ce], g[rows, cs:ce],
                         beta[rows, cs:ce], states if live == n else states[:live],
                         outputs=outputs, step=final_state or ce < length)
        if o is not None:
            o[rows, cs:ce] = o_chunk
    return None if o is None else o.view(n, hv, length, -1).transpose(1, 2)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, states: States, *, outputs: bool, step: bool
           ) -> torch.Tensor | None:
    """One chunk of every (sequence, head): ``reference._chunk_step`` batched, on states in
    pool layout, stepped in place when ``step``.

    q, k: [B, L, K]; v: [B, L, V]; g, beta: [B, L] (B = N*HV). Returns the outputs [B, L, V]
    (None without ``outputs``).
    """
    size = g.shape[-1]
    gamma = g.cumsum(-1)  # log decay from the chunk start up to and including each token
    # masked before exp: the upper triangle holds positive exponents that can overflow
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    decay = drop_negligible((gamma[:, :, None] - gamma[:, None, :]).masked_fill(
        ~causal, float("-inf")).exp())
    from_start = drop_negligible(gamma.exp())[..., None]  # [B, L, 1]
    kb = k * beta[..., None]
    system = torch.bmm(kb, k.transpose(1, 2)) * decay
    rhs = torch.cat([kb * from_start, v * beta[..., None]], dim=-1)
    w, u = torch.linalg.solve_triangular(system, rhs, upper=False,
                                         unitriangular=True).split([k.shape[-1], v.shape[-1]], -1)
    # the solve compounds decays along chains of tokens: w's range has no floor
    w = drop_negligible(w)
    # the states' only read for this chunk: w S (and q S for the outputs) in one product
    products = _read(states, torch.cat([w, q * from_start], dim=1) if outputs else w)
    v_new = u - products[:, :size]
    if step:
        last = gamma[:, -1:]
        _step(states, drop_negligible(last.exp())[..., None], v_new.transpose(1, 2),
              k * drop_negligible((last - gamma).exp())[..., None])
    if not outputs:
        return None
    attn = torch.bmm(q, k.transpose(1, 2)) * decay
    return products[:, size:] + torch.bmm(attn, v_new)


def _read(states: States, lhs: torch.Tensor) -> torch.Tensor:
    """``lhs @ S^T`` for every (sequence, head): lhs [B, M, K] -> [B, M, V]."""
    if isinstance(states, torch.Tensor):
        return torch.bmm(lhs, states.flatten(0, 1).transpose(1, 2))
    per_sequence = lhs.view(len(states), -1, *lhs.shape[1:])
    return torch.cat([torch.bmm(part, s.transpose(1, 2))
                      for part, s in zip(per_sequence, states)])


def _step(states: States, decay: torch.Tensor, values: torch.Tensor, keys: torch.Tensor) -> None:
    """``S = decay S + values @ keys`` in place: decay [B, 1, 1], values [B, V, L], keys
    [B, L, K]."""
    if isinstance(states, torch.Tensor):
        states.flatten(0, 1).mul_(decay).baddbmm_(values, keys)
        return
    n = len(states)
    decay, values, keys = (t.view(n, -1, *t.shape[1:]) for t in (decay, values, keys))
    for i, s in enumerate(states):
        s.mul_(decay[i]).baddbmm_(values[i], keys[i])
