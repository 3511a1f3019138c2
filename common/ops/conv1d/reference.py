"""Plain-torch short causal depthwise conv1d over packed sequences, with a rolling input state.

The conv state of a sequence is its last W-1 *inputs*, oldest first: ``[N, D, W-1]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update", "conv1d_update_in_place",
           "check_activation", "check_in_place"]

_ACTIVATIONS = ("silu", None)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_activation(activation: str | None) -> None:
    """ValueError unless ``activation`` is one the conv applies ("silu" or None)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def _check_weight(weight: torch.Tensor, d: int) -> int:
    if weight.dim() != 2 or weight.shape[0] != d or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={d}, W] with W >= 1, got {tuple(weight.shape)}")
    return weight.shape[1]


def _conv(window: torch.Tensor, weight: torch.Tensor, length: int, activation: str | None) -> torch.Tensor:
    """window: [length + W - 1, D] inputs in compute dtype; returns [length, D]."""
    width = weight.shape[1]
    y = torch.zeros(length, window.shape[1], dtype=window.dtype, device=window.device)
    # W is 4 in practice: W shifted multiply-adds beat an im2col and keep the sum order fixed.
    for s in range(width):
        y = y + window[s : s + length] * weight[:, s]
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_prefill(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of every packed sequence, continuing from its cached inputs.

    ``y[t, c] = act(sum_s weight[c, s] * x[t - (W-1) + s, c])``, where inputs before the sequence start
    come from ``initial_state`` (zeros when None). ``weight[:, W-1]`` multiplies the current token.

    Args:
        x: [T, D] packed inputs.
        weight: [D, W] depthwise filter.
        cu_seqlens: integer [N+1] offsets of the N sequences.
        initial_state: [N, D, W-1] previous inputs, oldest first, or None.
        activation: "silu" or None.

    Returns:
        y: [T, D] in x.dtype.
        final_state: [N, D, W-1] in x.dtype, the last W-1 inputs of cat(initial_state, sequence);
            this also covers sequences shorter than W-1.
    """
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    t, d = x.shape
    width = _check_weight(weight, d)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be an integer tensor [N+1] with N >= 1")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != t or any(e < s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={t}, got {bounds}")
    n = len(bounds) - 1
    if initial_state is not None and initial_state.shape != (n, d, width - 1):
        raise ValueError(f"initial_state must be [{n}, {d}, {width - 1}], got {tuple(initial_state.shape)}")

    dt = _compute_dtype(x, weight)
    w = weight.to(dt)
    y = torch.empty(t, d, dtype=dt, device=x.device)
    final_state = torch.empty(n, d, width - 1, dtype=x.dtype, device=x.device)
    for r, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if initial_state is None:
            history = torch.zeros(width - 1, d, dtype=dt, device=x.device)
        else:
            history = initial_state[r].to(dt).transpose(0, 1)
        window = torch.cat([history, x[start:end].to(dt)], dim=0)  # [W-1 + L, D]
        y[start:end] = _conv(window, w, end - start, activation)
        final_state[r] = window[window.shape[0] - (width - 1) :].transpose(0, 1).to(x.dtype)
    return y.to(x.dtype), final_state


def causal_conv1d_update(
    *,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence (decode). Functional: conv_state is not modified.

    Args:
        x: [N, D] the new input of each sequence.
        conv_state: [N, D, W-1] previous inputs, oldest first.
        weight: [D, W].
        activation: "silu" or None.

    Returns:
        y: [N, D] in x.dtype.
        new_state: [N, D, W-1] in conv_state.dtype, the window shifted left by one with x appended.
    """
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got {tuple(x.shape)}")
    n, d = x.shape
    width = _check_weight(weight, d)
    if conv_state.shape != (n, d, width - 1):
        raise ValueError(f"conv_state must be [{n}, {d}, {width - 1}], got {tuple(conv_state.shape)}")
    dt = _compute_dtype(x, weight, conv_state)
    # The state stores inputs in its own dtype, so the token is rounded the way a later step will see it.
    window = torch.cat([conv_state, x.to(conv_state.dtype)[:, :, None]], dim=-1)  # [N, D, W]
    # Same kernel and summation order as the prefill, so decode reproduces prefill bit for bit.
    y = _conv(window.to(dt).permute(2, 0, 1).reshape(width, n * d), weight.to(dt).repeat(n, 1), 1, activation)
    return y.reshape(n, d).to(x.dtype), window[:, :, 1:].clone()


def check_in_place(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> int:
    """Shape rules of :func:`conv1d_update_in_place`, from metadata only; returns W."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got {tuple(x.shape)}")
    n, d = x.shape
    width = _check_weight(weight, d)
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (d, width - 1):
        raise ValueError(f"conv_pool must be [S, {d}, {width - 1}], got {tuple(conv_pool.shape)}")
    if slots.dim() != 1 or slots.is_floating_point() or slots.numel() != n:
        raise ValueError(f"slots must be an integer tensor [N={n}], got {slots.dtype} {tuple(slots.shape)}")
    return width


def conv1d_update_in_place(
    *,
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new token per request, reading and writing its window in the pool by slot.

    Exactly :func:`causal_conv1d_update` on the gathered rows ``conv_pool[slots]``, whose new
    state is written back into the same rows.

    Args:
        x: [N, D] the new input of each request.
        conv_pool: [S, D, W-1] windows of one layer (``GDNStatePool.conv[layer]``), updated in
            place; rows not named in ``slots`` are left untouched.
        slots: integer [N] pool row of each request. Rows must be distinct, except that padding
            rows may all name slot 0 (scratch): what lands there is unspecified.
        weight: [D, W].
        activation: "silu" or None.

    Returns:
        y: [N, D] in x.dtype.
    """
    check_activation(activation)
    check_in_place(x, conv_pool, slots, weight)
    index = slots.to(device=conv_pool.device, dtype=torch.long)
    y, new_state = causal_conv1d_update(x=x, conv_state=conv_pool[index], weight=weight,
                                        activation=activation)
    conv_pool[index] = new_state
    return y
