"""Triton short causal depthwise conv1d (prefill over packed sequences, and the one-token update).

Same signatures, state layout and return conventions as ``common.ops.conv1d.reference``: the conv
state is the last W-1 *inputs* of each sequence, oldest first, ``[N, D, W-1]``. Library kernels
(fla's ``causal_conv1d``, Dao-AILab's ``causal-conv1d``) keep W columns ``[N, D, W]`` and update
their cache in place; these kernels read and write our layout directly and leave every input
untouched, so no conversion or copy is needed at the op boundary.

Arithmetic matches the reference: inputs are widened to fp32, the W taps are summed in tap order,
silu in fp32, one rounding to x.dtype at the end. Rows of ``x`` may be strided (a view into a
wider projection output) as long as the channel dim is contiguous.

``conv1d_update_in_place`` is the decode step on the state pool itself: each request's window
is read from, and written back to, its pool row ``slots[n]``, with no gather or scatter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.ops.conv1d import reference

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update", "conv1d_update_in_place"]

# TRITON_INTERPRET=1 runs the kernels on CPU tensors (fp32/fp16 only), which the CPU tests use.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_BLOCK_T = 16
_BLOCK_D = 128


@triton.jit
def _conv_prefill_kernel(
    x, stride_xt, w, stride_wd, state, stride_sn, stride_sd, stride_sw, seq_idx, cu, y,
    T, D,
    W: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_t = offs_t < T
    mask_d = offs_d < D
    seq = tl.load(seq_idx + offs_t, mask=mask_t, other=0).to(tl.int64)
    bos = tl.load(cu + seq, mask=mask_t, other=0).to(tl.int64)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for s in tl.static_range(W):
        src = offs_t.to(tl.int64) - (W - 1) + s
        in_seq = src >= bos
        m_x = (mask_t & in_seq)[:, None] & mask_d[None, :]
        xv = tl.load(x + src[:, None] * stride_xt + offs_d[None, :], mask=m_x, other=0.0).to(tl.float32)
        if HAS_STATE:
            col = src - bos + (W - 1)  # in [0, W-2] whenever src precedes the sequence start
            m_s = (mask_t & (src < bos))[:, None] & mask_d[None, :]
            sv = tl.load(state + seq[:, None] * stride_sn + offs_d[None, :] * stride_sd + col[:, None] * stride_sw,
                         mask=m_s, other=0.0).to(tl.float32)
            xv = tl.where(in_seq[:, None], xv, sv)
        wv = tl.load(w + offs_d * stride_wd + s, mask=mask_d, other=0.0).to(tl.float32)
        acc = acc + xv * wv[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + offs_t.to(tl.int64)[:, None] * D + offs_d[None, :], acc.to(y.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _conv_final_state_kernel(
    x, stride_xt, state, stride_sn, stride_sd, stride_sw, cu, out, D,
    W: tl.constexpr, HAS_STATE: tl.constexpr, BD: tl.constexpr,
):
    """out[n, :, j] = cat(state[n], x[seq n])[len + j] for j < W-1 (out is contiguous [N, D, W-1])."""
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    bos = tl.load(cu + n).to(tl.int64)
    length = tl.load(cu + n + 1).to(tl.int64) - bos
    for j in tl.static_range(W - 1):
        i = length + j  # index into cat(state, sequence), whose first W-1 entries are the state
        from_x = i >= W - 1
        xv = tl.load(x + (bos + i - (W - 1)) * stride_xt + offs_d, mask=mask_d & from_x, other=0.0)
        if HAS_STATE:
            sv = tl.load(state + n * stride_sn + offs_d * stride_sd + i * stride_sw,
                         mask=mask_d & (i < W - 1), other=0.0)
            val = tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))
        else:
            val = tl.where(from_x, xv.to(tl.float32), 0.0)
        tl.store(out + n * D * (W - 1) + offs_d * (W - 1) + j, val.to(out.dtype.element_ty), mask=mask_d)


@triton.jit
def _conv_update_kernel(
    x, stride_xn, state, stride_sn, stride_sd, stride_sw, w, stride_wd, y, new_state, D,
    W: tl.constexpr, SILU: tl.constexpr, BD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    # the token is rounded to the state's dtype first, as the next step will read it from the state
    xv = tl.load(x + n * stride_xn + offs_d, mask=mask_d, other=0.0).to(new_state.dtype.element_ty)
    acc = tl.zeros([BD], dtype=tl.float32)
    for s in tl.static_range(W - 1):
        sv = tl.load(state + n * stride_sn + offs_d * stride_sd + s * stride_sw, mask=mask_d, other=0.0)
        wv = tl.load(w + offs_d * stride_wd + s, mask=mask_d, other=0.0).to(tl.float32)
        acc = acc + sv.to(tl.float32) * wv
        if s > 0:
            tl.store(new_state + n * D * (W - 1) + offs_d * (W - 1) + (s - 1),
                     sv.to(new_state.dtype.element_ty), mask=mask_d)
    wv = tl.load(w + offs_d * stride_wd + (W - 1), mask=mask_d, other=0.0).to(tl.float32)
    acc = acc + xv.to(tl.float32) * wv
    tl.store(new_state + n * D * (W - 1) + offs_d * (W - 1) + (W - 2), xv, mask=mask_d)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + n * D + offs_d, acc.to(y.dtype.element_ty), mask=mask_d)


@triton.jit
def _conv_update_in_place_kernel(
    x, stride_xn, pool, slots, stride_ss, stride_sd, stride_sw, w, stride_wd, y, D,
    W: tl.constexpr, BW: tl.constexpr, SILU: tl.constexpr, BD: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    slot = tl.load(slots + n).to(tl.int64)
    row = pool + slot * stride_ss + offs_d[:, None] * stride_sd  # [BD, 1]
    cols = tl.arange(0, BW)[None, :]  # window column, oldest first; BW >= W
    # The whole window in registers: the W-1 stored inputs, then the token rounded to the pool's
    # dtype (as the next step will read it from the pool).
    old = tl.load(row + cols * stride_sw, mask=mask_d[:, None] & (cols < W - 1), other=0.0)
    xv = tl.load(x + n * stride_xn + offs_d, mask=mask_d, other=0.0).to(pool.dtype.element_ty)
    win = tl.where(cols == W - 1, xv[:, None], old)
    winf = win.to(tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    for s in tl.static_range(W):
        # column s on its own (the other terms are exact zeros), so taps add in the reference's order
        col = tl.sum(tl.where(cols == s, winf, 0.0), axis=1)
        wv = tl.load(w + offs_d * stride_wd + s, mask=mask_d, other=0.0).to(tl.float32)
        acc = acc + col * wv
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + n * D + offs_d, acc.to(y.dtype.element_ty), mask=mask_d)
    # Window column c moves to c-1 in place. Another thread of this program may hold column c-1,
    # so every thread must have read its old columns before any writes: hence the barrier.
    tl.debug_barrier()
    tl.store(row + (cols - 1) * stride_sw, win, mask=mask_d[:, None] & (cols >= 1) & (cols < W))


def _rows_strided(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (rows may be strided), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _weight(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def _supported(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda or _INTERPRET for t in tensors) and all(t.dtype != torch.float64 for t in tensors)


def causal_conv1d_prefill(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.conv1d.reference.causal_conv1d_prefill` (same contract).

    ``cu_seqlens`` may live on the CPU (as ``ForwardBatch.cu_seqlens`` does) or on the GPU; it is
    never read on the host here. CPU or fp64 tensors and W < 2 go to the reference.
    """
    others = [weight] + ([initial_state] if initial_state is not None else [])
    if (not _supported(x, *others) or x.dim() != 2 or weight.dim() != 2 or weight.shape[1] < 2
            or activation not in ("silu", None)):
        return reference.causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=cu_seqlens,
                                               initial_state=initial_state, activation=activation)
    t, d = x.shape
    width = weight.shape[1]
    if weight.shape[0] != d:
        raise ValueError(f"weight must be [D={d}, W], got {tuple(weight.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be an integer tensor [N+1] with N >= 1")
    n = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, d, width - 1):
        raise ValueError(f"initial_state must be [{n}, {d}, {width - 1}], got {tuple(initial_state.shape)}")
    x = _rows_strided(x)
    weight = _weight(weight)
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64, non_blocking=True)
    # sequence id of every token, built on the device (no host sync; T is known from x)
    seq_idx = torch.repeat_interleave(torch.arange(n, device=x.device, dtype=torch.int32), cu.diff(),
                                      output_size=t)
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    final = torch.empty(n, d, width - 1, dtype=x.dtype, device=x.device)
    has_state = initial_state is not None
    st = initial_state if has_state else x  # dummy pointer when there is no state
    s_strides = initial_state.stride() if has_state else (0, 0, 0)
    if t > 0:
        grid = (triton.cdiv(t, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
        _conv_prefill_kernel[grid](
            x, x.stride(0), weight, weight.stride(0), st, *s_strides, seq_idx, cu, y, t, d,
            W=width, HAS_STATE=has_state, SILU=activation == "silu", BT=_BLOCK_T, BD=_BLOCK_D)
    _conv_final_state_kernel[(n, triton.cdiv(d, _BLOCK_D))](
        x, x.stride(0), st, *s_strides, cu, final, d, W=width, HAS_STATE=has_state, BD=_BLOCK_D)
    return y, final


def causal_conv1d_update(
    *,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`common.ops.conv1d.reference.causal_conv1d_update` (same contract:
    functional, ``conv_state`` is not modified; the new state is in conv_state.dtype)."""
    if (not _supported(x, conv_state, weight) or x.dim() != 2 or weight.dim() != 2
            or weight.shape[1] < 2 or activation not in ("silu", None)):
        return reference.causal_conv1d_update(x=x, conv_state=conv_state, weight=weight,
                                              activation=activation)
    n, d = x.shape
    width = weight.shape[1]
    if weight.shape[0] != d:
        raise ValueError(f"weight must be [D={d}, W], got {tuple(weight.shape)}")
    if conv_state.shape != (n, d, width - 1):
        raise ValueError(f"conv_state must be [{n}, {d}, {width - 1}], got {tuple(conv_state.shape)}")
    x = _rows_strided(x)
    weight = _weight(weight)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    new_state = torch.empty(n, d, width - 1, dtype=conv_state.dtype, device=x.device)
    if n > 0:
        _conv_update_kernel[(n, triton.cdiv(d, _BLOCK_D))](
            x, x.stride(0), conv_state, *conv_state.stride(), weight, weight.stride(0), y, new_state, d,
            W=width, SILU=activation == "silu", BD=_BLOCK_D)
    return y, new_state


def conv1d_update_in_place(
    *,
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton version of :func:`common.ops.conv1d.reference.conv1d_update_in_place` (same
    contract: y in x.dtype, the shifted window written into ``conv_pool[slots]``).

    One launch, no host synchronisation and no allocation besides ``y`` (and a copy of ``x`` only
    when its channel dim is strided), so the call can be captured in a CUDA graph. ``slots`` must
    live on the pool's device and is not range-checked (that would need a host read). CPU or
    fp64 tensors and W < 2 go to the reference.
    """
    if (not _supported(x, conv_pool, weight) or x.dim() != 2 or weight.dim() != 2
            or weight.shape[1] < 2 or activation not in ("silu", None)):
        return reference.conv1d_update_in_place(x=x, conv_pool=conv_pool, slots=slots, weight=weight,
                                                activation=activation)
    width = reference.check_in_place(x, conv_pool, slots, weight)
    if slots.device != conv_pool.device:
        raise ValueError(f"slots must be on the pool's device ({conv_pool.device}), got {slots.device}")
    n, d = x.shape
    x = _rows_strided(x)
    weight = _weight(weight)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n > 0:
        _conv_update_in_place_kernel[(n, triton.cdiv(d, _BLOCK_D))](
            x, x.stride(0), conv_pool, slots, *conv_pool.stride(), weight, weight.stride(0), y, d,
            W=width, BW=triton.next_power_of_2(width), SILU=activation == "silu", BD=_BLOCK_D)
    return y
