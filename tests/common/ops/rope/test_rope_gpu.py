"""Triton partial NeoX RoPE against the reference, on the GPU.

The kernel forms the same fp32 angles, takes torch's cos/sin, and rounds cos/sin, each product and
the sum to the tensor's dtype as the reference does, so bf16 results agree within one bf16 ulp of
the value (in practice exactly) and fp32 within 1e-5 relative. q and k are strided views, as the
model passes them; the inputs must come back untouched.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.rope import reference as ref
from tests.common.compare import assert_within_ulps

pytestmark = pytest.mark.gpu


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.rope import triton as rope_triton

    return rope_triton


def _qk(gen, tokens, heads, kv_heads, head_dim, dtype):
    """q: the first half of each head of a [T, H, 2·D] projection; k: a column slice of a
    [T, (2·KVH + 1)·D] one."""
    qg = torch.randn(tokens, heads, 2 * head_dim, generator=gen, device="cuda").to(dtype)
    kv = torch.randn(tokens, (2 * kv_heads + 1) * head_dim, generator=gen, device="cuda").to(dtype)
    q = qg[..., :head_dim]
    k = kv[:, head_dim : (kv_heads + 1) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 301])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim",
    [(16, 4, 256, 64), (16, 2, 256, 64), (8, 8, 128, 128), (5, 3, 96, 34)],
)
def test_rope_matches_reference(record_metric, dtype, tokens, heads, kv_heads, head_dim, rotary_dim):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens * head_dim + heads)
    q, k = _qk(gen, tokens, heads, kv_heads, head_dim, dtype)
    positions = torch.randint(0, 262_144, (tokens,), generator=gen, device="cuda")
    inv_freq = ref.rope_inv_freq(rotary_dim=rotary_dim, theta=10_000_000.0).cuda()
    before = (q.clone(), k.clone())
    q_rot, k_rot = tr.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    q_ref, k_ref = ref.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    assert_within_ulps(q_rot, q_ref, record_metric, "q")
    assert_within_ulps(k_rot, k_ref, record_metric, "k")
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_rope_mixed_dtypes_int32_positions_and_no_rotary_dims(record_metric):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(9, 3, 40, generator=gen, device="cuda")
    k = torch.randn(9, 1, 40, generator=gen, device="cuda").bfloat16()
    positions = torch.arange(9, device="cuda", dtype=torch.int32) * 1000 + 7
    for rotary_dim in (40, 10):
        inv_freq = ref.rope_inv_freq(rotary_dim=rotary_dim, theta=10_000.0).cuda()
        got = tr.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
        want = ref.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
        assert_within_ulps(got[0], want[0], record_metric, f"q_r{rotary_dim}")
        assert_within_ulps(got[1], want[1], record_metric, f"k_r{rotary_dim}")
    none = torch.empty(0, device="cuda")
    q_rot, k_rot = tr.apply_rope(q=q, k=k, positions=positions, inv_freq=none)
    assert torch.equal(q_rot, q) and torch.equal(k_rot, k)


def test_cpu_and_fp64_go_to_the_reference_and_bad_shapes_raise():
    tr = _triton()
    q, k, positions = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.arange(4)
    inv_freq = ref.rope_inv_freq(rotary_dim=8, theta=10_000.0)
    for got, want in zip(tr.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq),
                         ref.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)):
        assert torch.equal(got, want)
    q, k, positions, inv_freq = q.cuda(), k.cuda(), positions.cuda(), inv_freq.cuda()
    q64, _ = tr.apply_rope(q=q.double(), k=k.double(), positions=positions, inv_freq=inv_freq)
    assert q64.dtype == torch.float64
    with pytest.raises(ValueError, match="q must be"):
        tr.apply_rope(q=q, k=k[..., :6], positions=positions, inv_freq=inv_freq)
    with pytest.raises(ValueError, match="positions must be"):
        tr.apply_rope(q=q, k=k, positions=positions.float(), inv_freq=inv_freq)
    with pytest.raises(ValueError, match="inv_freq must be"):
        tr.apply_rope(q=q, k=k, positions=positions, inv_freq=torch.ones(5, device="cuda"))


def test_rope_replays_in_a_cuda_graph():
    """No host synchronisation: the op captures, and a replay sees new positions and inputs."""
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k = _qk(gen, 4, 16, 4, 256, torch.bfloat16)
    positions = torch.arange(4, device="cuda")
    inv_freq = ref.rope_inv_freq(rotary_dim=64, theta=10_000_000.0).cuda()
    tr.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_rot, k_rot = tr.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    positions.add_(12_345)
    q.mul_(-0.5)
    graph.replay()
    torch.cuda.synchronize()
    q_new, k_new = tr.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
    assert torch.equal(q_rot, q_new) and torch.equal(k_rot, k_new)
