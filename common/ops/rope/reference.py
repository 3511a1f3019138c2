"""Plain-torch partial NeoX rotary embedding of Qwen3.5 / Qwen3-Next full-attention layers (text only)."""

from __future__ import annotations

import torch

__all__ = ["rope_inv_freq", "apply_rope"]


def rope_inv_freq(*, rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies ``1 / theta^(i / rotary_dim)`` for i = 0, 2, ..., rotary_dim - 2.

    Formed exactly as transformers does (int64 arange cast to fp32, fp32 power), so the angles agree bitwise.

    Returns:
        [rotary_dim // 2] fp32.
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if theta <= 0:
        raise ValueError(f"theta must be positive, got {theta}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim
    return 1.0 / (theta**exponents)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]  # broadcast over heads
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def apply_rope(
    *, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``2 * len(inv_freq)`` dims of every q and k head (NeoX halves); the rest pass through.

    cos/sin come from fp32 angles ``positions * inv_freq`` (fp64 for fp64 q) and are rounded to the
    tensor's dtype before use, as transformers' rotary embedding + ``apply_rotary_pos_emb`` do; for
    text-only input Qwen3.5's M-RoPE reduces to this.

    Args:
        q: [T, H, D]. k: [T, KVH, D].
        positions: [T] integer absolute positions.
        inv_freq: [rotary_dim // 2], e.g. from ``rope_inv_freq``.

    Returns:
        (q, k) rotated, in q.dtype and k.dtype.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, KVH, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.is_floating_point():
        raise ValueError(f"positions must be an integer [{q.shape[0]}] tensor, got {tuple(positions.shape)}")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > q.shape[2]:
        raise ValueError(f"inv_freq must be [r/2] with r <= head dim {q.shape[2]}, got {tuple(inv_freq.shape)}")
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    freqs = positions.to(dt)[:, None] * inv_freq.to(dt)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, r]: the same angle drives dims i and i + r/2
    cos, sin = emb.cos(), emb.sin()
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
