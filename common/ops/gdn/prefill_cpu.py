"""The chunked GDN prefill (``reference.chunk_gated_delta_rule``) in plain torch, fast on the CPU.

The reference walks the packed sequences one by one and each chunk of a sequence on its own:
for a prefill of 16 prompts of 128 tokens that is 32 chunk steps per layer, each a dozen small
matmuls and two triangular solves over the heads of one sequence, so the step's time goes to
per-call overhead, not to arithmetic. Here the sequences sit in one padded ``[N, L]`` block,
longest first, and the block is walked chunk by chunk with the CPU verify's batched chunk step
(``replay_cpu.walk``): one set of matmuls per chunk for every (sequence, head). A chunk leaves
out the sequences that ended before it, and a sequence under half the longest goes to a block of
its own, so a long prompt beside short ones costs the short ones no padded chunks. Padding
tokens have a zero key, write strength and log decay: they leave the state as it was.

The same numbers as the reference to fp32 rounding (gate factors under e**-40 taken as 0, as
in the other CPU GDN backends: ``decode_cpu.NEGLIGIBLE``). The lengths are read on the host.
"""

from __future__ import annotations

import itertools

import torch

from common.ops.gdn._common import check_shapes
from common.ops.gdn.decode_cpu import drop_negligible, l2_normalised
from common.ops.gdn.replay_cpu import sequence_lengths, walk
from common.ops.padded_block import padded

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over packed sequences: the contract of
    ``reference.chunk_gated_delta_rule`` (same arguments, checks and result to fp32 rounding).

    Args:
        q, k: [T, HK, K]. v: [T, HV, V], HV a multiple of HK. g: [T, HV] log decay (<= 0).
        beta: [T, HV]. cu_seqlens: integer [N+1] offsets (read on the host).
        initial_state: [N, HV, K, V] or None for zeros; never modified.
        scale: multiplies q after the l2norm; default K**-0.5.
        use_qk_l2norm: l2-normalise q and k over K (eps 1e-6) first.
        chunk_size: tokens per chunk.

    Returns:
        o: [T, HV, V] in v.dtype; final_state: [N, HV, K, V] fp32 (fp64 for fp64 inputs).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    t, hk, dk, hv, dv, n = check_shapes(q, k, v, g, beta, cu_seqlens, initial_state)
    lens = sequence_lengths(cu_seqlens, t)
    dt = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    device = v.device
    # longest first, so the sequences still running at any chunk are a prefix of the block
    order = sorted(range(n), key=lambda i: -lens[i])
    sorted_lens = [lens[i] for i in order]
    ranks = torch.tensor(order, device=device)
    # the states in pool layout [N, HV, V, K] (what the walk steps), a copy in block order
    states = torch.empty(n, hv, dv, dk, dtype=dt, device=device)
    if initial_state is None:
        states.zero_()
    else:
        states.copy_(initial_state.index_select(0, ranks).transpose(-1, -2))
    final = torch.empty(n, hv, dk, dv, dtype=dt, device=device)
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=device)
    if t:
        # per token once, on the packed rows (padding is never normalised, cast or gated)
        qk = l2_normalised(torch.stack([q.to(dt), k.to(dt)], dim=1), use_qk_l2norm, dim=-1)
        tokens = (qk[:, 0] * (dk ** -0.5 if scale is None else scale), qk[:, 1], v.to(dt),
                  g.to(dt), drop_negligible(beta.to(dt)))
        starts = list(itertools.accumulate(lens[:-1], initial=0))
        for first, end in _groups(sorted_lens, chunk_size):
            seqs = order[first:end]
            _walk_group(tokens, out, states[first:end], [lens[i] for i in seqs],
                        [starts[i] for i in seqs], chunk_size)
    final[ranks] = states.transpose(-1, -2)
    return out, final


def _groups(lens: list[int], chunk: int) -> list[tuple[int, int]]:
    """Runs ``[first, end)`` of the lengths (longest first) walked as one padded block: a
    sequence under half the block's longest (counted as at least a chunk) starts a new one, so
    a block pads no sequence past twice its length or twice a chunk (one long prompt beside
    short ones would otherwise gather, mask and lay out mostly padding)."""
    groups, first = [], 0
    for i, x in enumerate(lens):
        if x == 0:
            break  # empty sequences keep their states as they are
        if 2 * max(x, chunk) < lens[first]:
            groups.append((first, i))
            first = i
    else:
        i = len(lens)
    if i > first:
        groups.append((first, i))
    return groups


def _walk_group(tokens: tuple[torch.Tensor, ...], out: torch.Tensor, states: torch.Tensor,
                lens: list[int], starts: list[int], chunk: int) -> None:
    """Sequences (lengths ``lens``, longest first, packed from rows ``starts``) walked as one
    padded block from ``states`` (stepped in place); their outputs written to ``out``."""
    n, length = len(lens), lens[0]
    index, real = padded(lens, out.device, starts)

    def block(x: torch.Tensor) -> torch.Tensor:
        x = x[starts[0]:starts[0] + n * length] if index is None else x[index]
        return x.view(n, length, *x.shape[1:])

    pad = None if lens[-1] == length else ~real
    o = walk(*(block(x) for x in tokens), states, pad=pad, lens=lens, chunk=chunk)
    o = o.to(out.dtype)  # [N, L, HV, V]
    if index is None:
        out[starts[0]:starts[0] + n * length] = o.flatten(0, 1)
    else:
        out[index.view(n, length)[real]] = o[real]
