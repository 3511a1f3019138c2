"""The q/k norm + RoPE + KV store composition and the sigmoid output gate, on the CPU.

Each reference is the step-by-step composition of existing ops, which is checked first; the other
tests check properties worked out by hand (unit RMS, the rotation angle of a column pair, identity
at position 0, untouched cache slots, sigmoid(0) = 1/2) so that the composition itself is tested.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.ops.attention.kv_store_reference import store_paged_kv
from common.ops.attention.output_gate_reference import sigmoid_gate_mul
from common.ops.attention.qk_prep_reference import qk_norm_rope_store
from common.ops.norm.reference import rms_norm
from common.ops.rope.reference import apply_rope, rope_inv_freq

EPS = 1e-6
PAGE = 4


def _inputs(gen, *, tokens=3, heads=3, kv_heads=2, head_dim=10, rotary_dim=6, dtype=torch.float32):
    """q, gate, k and v as the model slices them from one fused projection, plus norm weights,
    positions, frequencies, a pool layer with random contents and shuffled distinct slots."""
    proj = torch.randn(tokens, (2 * heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qg, k, v = torch.split(proj, [2 * heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    qg = qg.view(tokens, heads, 2 * head_dim)
    pages = -(-tokens // PAGE) + 2
    return dict(
        q=qg[..., :head_dim], k=k.view(tokens, kv_heads, head_dim), v=v.view(tokens, kv_heads, head_dim),
        q_weight=(torch.randn(head_dim, generator=gen) * 0.3).to(dtype),
        k_weight=(torch.randn(head_dim, generator=gen) * 0.3).to(dtype),
        positions=torch.randint(1, 5000, (tokens,), generator=gen),
        inv_freq=rope_inv_freq(rotary_dim=rotary_dim, theta=10_000.0),
        kv=torch.randn(pages, 2, PAGE, kv_heads, head_dim, generator=gen).to(dtype),
        loc=torch.randperm(pages * PAGE, generator=gen)[:tokens],
    ), qg[..., head_dim:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,rotary_dim",
                         [(1, 3, 1, 10, 6), (5, 3, 2, 14, 14), (7, 4, 2, 9, 4)])
def test_equals_the_separate_ops(dtype, tokens, heads, kv_heads, head_dim, rotary_dim):
    gen = torch.Generator().manual_seed(tokens * head_dim)
    a, _ = _inputs(gen, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   rotary_dim=rotary_dim, dtype=dtype)
    kv_want = a["kv"].clone()
    q_in, k_in, v_in = a["q"].clone(), a["k"].clone(), a["v"].clone()
    q_out, k_out = qk_norm_rope_store(eps=EPS, **a)

    qn = rms_norm(x=a["q"], weight=a["q_weight"], eps=EPS, zero_centered=True)
    kn = rms_norm(x=a["k"], weight=a["k_weight"], eps=EPS, zero_centered=True)
    q_want, k_want = apply_rope(q=qn, k=kn, positions=a["positions"], inv_freq=a["inv_freq"])
    store_paged_kv(kv=kv_want, loc=a["loc"], k=k_want, v=a["v"])
    assert torch.equal(q_out, q_want) and torch.equal(k_out, k_want)
    assert torch.equal(a["kv"], kv_want)
    assert q_out.dtype == dtype and q_out.shape == (tokens, heads, head_dim)
    assert torch.equal(a["q"], q_in) and torch.equal(a["k"], k_in) and torch.equal(a["v"], v_in)


def test_heads_have_unit_rms_with_zero_weights_at_any_position():
    """With w = 0 the scale is 1, and a rotation keeps each head's norm, so every output head has
    an RMS of 1 (eps = 0 here) whatever the positions."""
    gen = torch.Generator().manual_seed(1)
    a, _ = _inputs(gen, tokens=5, head_dim=12, rotary_dim=8, dtype=torch.float64)
    a["q"], a["k"] = a["q"] * 7, a["k"] * 0.01  # the norm must remove the scale
    a["q_weight"], a["k_weight"] = torch.zeros(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    q_out, k_out = qk_norm_rope_store(eps=0.0, **a)
    for x in (q_out, k_out):
        rms = x.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-9, atol=0)


def test_rotation_of_each_column_pair_by_hand():
    """Column i and column i + r/2 of a head turn by ``position * theta^(-2i/r)``; columns from r
    on pass through the norm alone; the stored k is the returned k and the stored v is v."""
    gen = torch.Generator().manual_seed(2)
    d, r, theta = 12, 8, 10_000.0
    a, _ = _inputs(gen, tokens=4, kv_heads=2, head_dim=d, rotary_dim=r, dtype=torch.float64)
    q_out, k_out = qk_norm_rope_store(eps=EPS, **a)
    for x, w, out in ((a["q"], a["q_weight"], q_out), (a["k"], a["k_weight"], k_out)):
        for t in range(x.shape[0]):
            for h in range(x.shape[1]):
                row = x[t, h].tolist()
                scale = 1 / math.sqrt(sum(e * e for e in row) / d + EPS)
                n = [e * scale * (1 + wi) for e, wi in zip(row, w.tolist())]
                p = int(a["positions"][t])
                want = list(n)
                for i in range(r // 2):
                    ang = p * theta ** (-2 * i / r)
                    x1, x2 = n[i], n[i + r // 2]
                    want[i] = x1 * math.cos(ang) - x2 * math.sin(ang)
                    want[i + r // 2] = x2 * math.cos(ang) + x1 * math.sin(ang)
                # the frequencies are fp32 (as transformers forms them), so angles are off by up
                # to position * 1e-7; a wrong pairing, sign or angle is off by O(1)
                torch.testing.assert_close(out[t, h], torch.tensor(want, dtype=torch.float64),
                                           rtol=0, atol=1e-3)
                torch.testing.assert_close(out[t, h, r:], torch.tensor(want[r:], dtype=torch.float64),
                                           rtol=1e-12, atol=0)
    page, offset = a["loc"] // PAGE, a["loc"] % PAGE
    assert torch.equal(a["kv"][page, 0, offset], k_out)
    assert torch.equal(a["kv"][page, 1, offset], a["v"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_zero_is_the_norm_alone(dtype):
    gen = torch.Generator().manual_seed(3)
    a, _ = _inputs(gen, tokens=3, head_dim=10, rotary_dim=10, dtype=dtype)
    a["positions"] = torch.zeros(3, dtype=torch.int64)
    q_out, k_out = qk_norm_rope_store(eps=EPS, **a)
    for x, w, out in ((a["q"], a["q_weight"], q_out), (a["k"], a["k_weight"], k_out)):
        h = x.double()
        want = h / (h.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * (1 + w.double())
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(out.double(), want, **tol)


def test_cache_slots_outside_loc_are_untouched_and_kv_casts():
    gen = torch.Generator().manual_seed(4)
    a, _ = _inputs(gen, tokens=5, kv_heads=2, head_dim=8, rotary_dim=4)
    a["kv"] = a["kv"].to(torch.bfloat16)  # a bf16 pool fed fp32 k / v: stored rounded
    before = a["kv"].clone()
    _, k_out = qk_norm_rope_store(eps=EPS, **a)
    page, offset = a["loc"] // PAGE, a["loc"] % PAGE
    written = torch.zeros(a["kv"].shape[0], PAGE, dtype=torch.bool)
    written[page, offset] = True
    kv, kv0 = a["kv"].transpose(1, 2), before.transpose(1, 2)  # [pages, page, 2, KVH, D]
    assert torch.equal(kv[~written], kv0[~written])
    assert torch.equal(a["kv"][page, 0, offset], k_out.to(torch.bfloat16))
    assert torch.equal(a["kv"][page, 1, offset], a["v"].to(torch.bfloat16))


def test_qk_prep_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(5)
    a, _ = _inputs(gen, tokens=3, heads=2, kv_heads=1, head_dim=8, rotary_dim=4)
    bad = {
        "q must be": dict(q=a["q"][..., :6]),
        "q_weight must be": dict(q_weight=a["q_weight"][:5]),
        "k_weight must be": dict(k_weight=a["k_weight"].view(2, 4)),
        "positions must be": dict(positions=a["positions"].float()),
        "inv_freq must be": dict(inv_freq=torch.ones(5)),
        "kv must be": dict(kv=a["kv"][:, 0]),
        "k and v must": dict(v=a["v"][:, :, :4]),
        "loc must": dict(loc=a["loc"][:2]),
    }
    for match, change in bad.items():
        with pytest.raises(ValueError, match=match):
            qk_norm_rope_store(eps=EPS, **{**a, **change})
    with pytest.raises(ValueError, match="q must be"):
        qk_norm_rope_store(eps=EPS, **{**a, "q": a["q"][0]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sigmoid_gate_mul_equals_torch_and_rounds_twice(dtype):
    gen = torch.Generator().manual_seed(6)
    _, gate = _inputs(gen, tokens=5, heads=3, head_dim=7, dtype=dtype)
    x = (torch.randn(5, 3, 7, generator=gen) * 3).to(dtype)
    out = sigmoid_gate_mul(x=x, gate=gate)
    assert out.shape == (5, 21) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, (x * torch.sigmoid(gate)).reshape(5, 21))
    if dtype != torch.float32:
        # sigmoid in fp32 rounded to the dtype, then the product (exact in fp32) rounded: two
        # roundings, which differ from one rounding of the whole fp32 expression
        xf, sig = x.float(), torch.sigmoid(gate.float())
        assert torch.equal(out, (xf * sig.to(dtype).float()).to(dtype).reshape(5, 21))
        assert not torch.equal(out, (xf * sig).to(dtype).reshape(5, 21))


def test_sigmoid_gate_mul_limits_by_hand():
    x = torch.tensor([[[1.5, -2.0, 3.0]]])
    assert torch.equal(sigmoid_gate_mul(x=x, gate=torch.zeros(1, 1, 3)), x.reshape(1, 3) / 2)
    assert torch.equal(sigmoid_gate_mul(x=x, gate=torch.full((1, 1, 3), 200.0)), x.reshape(1, 3))
    assert torch.equal(sigmoid_gate_mul(x=x, gate=torch.full((1, 1, 3), -200.0)), torch.zeros(1, 3))
    assert sigmoid_gate_mul(x=x[:0], gate=x[:0]).shape == (0, 3)


def test_sigmoid_gate_mul_rejects_bad_shapes():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="x must be"):
        sigmoid_gate_mul(x=x.view(2, 12), gate=x.view(2, 12))
    with pytest.raises(ValueError, match="gate must match"):
        sigmoid_gate_mul(x=x, gate=x[..., :3])
    with pytest.raises(ValueError, match="gate must match"):
        sigmoid_gate_mul(x=x, gate=x.bfloat16())
