"""Triton q/k norm + RoPE + KV store and the sigmoid output gate against their references, on the
GPU.

The fused kernel rounds where the reference rounds, with torch's rsqrt / cos / sin, so the only
difference is the order of the sum of squares of each head (a last-bit difference of the fp32
norm): q and k agree within one bf16 ulp of the value (fp32 within 1e-5 relative). The cache
slots at loc hold exactly the kernel's own k (cast to the pool dtype) and v; every other slot is
untouched. The gate kernel rounds as torch's two kernels do and must agree bit for bit. Inputs are
strided views of one fused projection, as the model passes them.
"""

from __future__ import annotations

import pytest
import torch

from common.cache.kv_pool import KVPool
from common.ops.attention import output_gate_reference as gate_ref
from common.ops.attention import qk_prep_reference as ref
from common.ops.rope.reference import rope_inv_freq
from tests.common.compare import assert_within_ulps, randn

pytestmark = pytest.mark.gpu

EPS = 1e-6
LAYERS = (3, 7)
PAGE = 16
SHAPES = [(16, 4, 256, 64), (6, 2, 96, 32)]  # (H, KVH, D, rotary_dim): Qwen3.5-4B, and odd sizes


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.attention import output_gate_triton, qk_prep_triton

    return qk_prep_triton, output_gate_triton


def _inputs(gen, *, tokens, heads, kv_heads, head_dim, rotary_dim, dtype, kv_dtype=None):
    """The model's views of one [T, (2H + 2KVH) * D] projection (q and gate interleaved per head),
    zero-centred norm weights, positions, a two-layer pool with random contents and distinct
    shuffled slots (slot 0 among them)."""
    d = head_dim
    proj = randn(gen, tokens, (2 * heads + 2 * kv_heads) * d, dtype=dtype) * 2
    qg, k, v = torch.split(proj, [2 * heads * d, kv_heads * d, kv_heads * d], dim=-1)
    qg = qg.view(tokens, heads, 2 * d)
    pool = KVPool(layer_ids=LAYERS, num_pages=-(-tokens // PAGE) + 3, page_size=PAGE,
                  num_kv_heads=kv_heads, head_dim=d, dtype=kv_dtype or dtype, device="cuda")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen, device="cuda"))
    n = pool.num_pages * PAGE
    loc = torch.cat([torch.randperm(n - 1, generator=gen, device="cuda")[:tokens - 1] + 1,
                     torch.zeros(1, dtype=torch.int64, device="cuda")])
    loc = loc[torch.randperm(tokens, generator=gen, device="cuda")]
    args = dict(q=qg[..., :d], k=k.view(tokens, kv_heads, d), v=v.view(tokens, kv_heads, d),
                q_weight=randn(gen, d, dtype=dtype) * 0.3, k_weight=randn(gen, d, dtype=dtype) * 0.3,
                positions=torch.randint(0, 262_144, (tokens,), generator=gen, device="cuda"),
                inv_freq=rope_inv_freq(rotary_dim=rotary_dim, theta=10_000_000.0).cuda(), loc=loc)
    return args, qg[..., d:], pool


def _check_pool(got, want_ref, before, loc, k_out, v, record, name):
    """Slots at loc: the kernel's k and v exactly, and the reference's within ulps; others as before."""
    page, offset = loc // PAGE, loc % PAGE
    assert torch.equal(got[page, 0, offset], k_out.to(got.dtype)), name
    assert torch.equal(got[page, 1, offset], v.to(got.dtype)), name
    assert_within_ulps(got[page, 0, offset].contiguous(), want_ref[page, 0, offset].contiguous(),
                       record, f"{name}.cache_k")
    written = torch.zeros(got.shape[0], PAGE, dtype=torch.bool, device=got.device)
    written[page, offset] = True
    keep = ~written
    assert torch.equal(got.transpose(1, 2)[keep], before.transpose(1, 2)[keep]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", SHAPES)
def test_qk_norm_rope_store_matches_reference(record_metric, dtype, tokens, heads, kv_heads,
                                              head_dim, rotary_dim):
    tq, _ = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens * head_dim + heads)
    args, _, pool = _inputs(gen, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            rotary_dim=rotary_dim, dtype=dtype)
    before = pool.kv.clone()
    inputs = {n: args[n].clone() for n in ("q", "k", "v")}
    want_kv = before[1].clone()
    q_out, k_out = tq.qk_norm_rope_store(eps=EPS, kv=pool.layer_kv(LAYERS[1]), **args)
    q_ref, k_ref = ref.qk_norm_rope_store(eps=EPS, kv=want_kv, **args)
    assert_within_ulps(q_out, q_ref, record_metric, "q")
    assert_within_ulps(k_out, k_ref, record_metric, "k")
    _check_pool(pool.kv[1], want_kv, before[1], args["loc"], k_out, args["v"], record_metric, "pool")
    assert torch.equal(pool.kv[0], before[0])  # the other layer
    for n, t in inputs.items():
        assert torch.equal(args[n], t), n


@pytest.mark.parametrize("kv_dtype,dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_qk_norm_rope_store_casts_into_the_pool(record_metric, kv_dtype, dtype):
    tq, _ = _triton()
    gen = torch.Generator(device="cuda").manual_seed(11)
    args, _, pool = _inputs(gen, tokens=9, heads=16, kv_heads=4, head_dim=256, rotary_dim=64,
                            dtype=dtype, kv_dtype=kv_dtype)
    before = pool.kv.clone()
    want_kv = before[0].clone()
    q_out, k_out = tq.qk_norm_rope_store(eps=EPS, kv=pool.layer_kv(LAYERS[0]), **args)
    q_ref, k_ref = ref.qk_norm_rope_store(eps=EPS, kv=want_kv, **args)
    assert_within_ulps(q_out, q_ref, record_metric, "q")
    assert_within_ulps(k_out, k_ref, record_metric, "k")
    _check_pool(pool.kv[0], want_kv, before[0], args["loc"], k_out, args["v"], record_metric, "pool")


def test_qk_norm_rope_store_full_and_no_rotary_dims(record_metric):
    tq, _ = _triton()
    gen = torch.Generator(device="cuda").manual_seed(12)
    for inv_freq in (rope_inv_freq(rotary_dim=96, theta=10_000.0).cuda(), torch.empty(0, device="cuda")):
        args, _, pool = _inputs(gen, tokens=5, heads=6, kv_heads=2, head_dim=96, rotary_dim=32,
                                dtype=torch.bfloat16)
        args["inv_freq"] = inv_freq
        want_kv = pool.kv[0].clone()
        q_out, k_out = tq.qk_norm_rope_store(eps=EPS, kv=pool.layer_kv(LAYERS[0]), **args)
        q_ref, k_ref = ref.qk_norm_rope_store(eps=EPS, kv=want_kv, **args)
        name = f"r{2 * inv_freq.numel()}"
        assert_within_ulps(q_out, q_ref, record_metric, f"{name}.q")
        assert_within_ulps(k_out, k_ref, record_metric, f"{name}.k")


def test_qk_prep_fallbacks_and_errors():
    tq, _ = _triton()
    gen = torch.Generator(device="cuda").manual_seed(13)
    args, _, pool = _inputs(gen, tokens=3, heads=2, kv_heads=1, head_dim=32, rotary_dim=16,
                            dtype=torch.float32)
    for conv in (lambda t: t.cpu(), lambda t: t.double() if t.is_floating_point() else t):
        a = {n: conv(t) for n, t in args.items()}
        got_kv, want_kv = conv(pool.kv[0].clone()), conv(pool.kv[0].clone())
        got = tq.qk_norm_rope_store(eps=EPS, kv=got_kv, **a)
        want = ref.qk_norm_rope_store(eps=EPS, kv=want_kv, **a)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got_kv, want_kv)
    kv = pool.layer_kv(LAYERS[0])
    with pytest.raises(ValueError, match="q_weight must be"):
        tq.qk_norm_rope_store(eps=EPS, kv=kv, **{**args, "q_weight": args["q_weight"][:5]})
    with pytest.raises(ValueError, match="loc must"):
        tq.qk_norm_rope_store(eps=EPS, kv=kv, **{**args, "loc": args["loc"][:2]})
    with pytest.raises(ValueError, match="inv_freq must be"):
        tq.qk_norm_rope_store(eps=EPS, kv=kv, **{**args, "inv_freq": torch.ones(17, device="cuda")})


def test_qk_norm_rope_store_replays_in_a_cuda_graph():
    """No host synchronisation: the launch captures, and a replay sees new inputs, positions and
    slots written in place."""
    tq, _ = _triton()
    gen = torch.Generator(device="cuda").manual_seed(14)
    args, _, pool = _inputs(gen, tokens=4, heads=16, kv_heads=4, head_dim=256, rotary_dim=64,
                            dtype=torch.bfloat16)
    kv = pool.layer_kv(LAYERS[0])
    tq.qk_norm_rope_store(eps=EPS, kv=kv, **args)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = tq.qk_norm_rope_store(eps=EPS, kv=kv, **args)
    args["positions"].add_(12_345)
    args["q"].mul_(-0.5)
    args["v"].add_(1.0)
    args["loc"].copy_((torch.roll(args["loc"], 1) + PAGE) % (pool.num_pages * PAGE))  # distinct
    want_kv = pool.kv[0].clone()
    q_ref, k_ref = tq.qk_norm_rope_store(eps=EPS, kv=want_kv, **args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(pool.kv[0], want_kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("heads,head_dim", [(16, 256), (6, 96)])
def test_sigmoid_gate_mul_is_bit_exact(record_metric, dtype, tokens, heads, head_dim):
    _, tg = _triton()
    gen = torch.Generator(device="cuda").manual_seed(tokens * head_dim + heads)
    _, gate, _ = _inputs(gen, tokens=tokens, heads=heads, kv_heads=1, head_dim=head_dim,
                         rotary_dim=32, dtype=dtype)
    x = randn(gen, tokens, heads, head_dim, dtype=dtype) * 3
    for g in (gate, gate * 3):  # the model's strided view, and a contiguous gate
        got = tg.sigmoid_gate_mul(x=x, gate=g)
        want = gate_ref.sigmoid_gate_mul(x=x, gate=g)
        record_metric("max_abs", (got.float() - want.float()).abs().max().item())
        assert got.shape == (tokens, heads * head_dim) and got.is_contiguous()
        assert torch.equal(got, want)
    # x as a strided view too (attention output written into a wider buffer)
    wide = randn(gen, tokens, heads, head_dim + 8, dtype=dtype)
    assert torch.equal(tg.sigmoid_gate_mul(x=wide[..., :head_dim], gate=gate),
                       gate_ref.sigmoid_gate_mul(x=wide[..., :head_dim], gate=gate))


def test_sigmoid_gate_mul_extremes_fallbacks_and_graph():
    _, tg = _triton()
    g = torch.tensor([0.0, 1e-3, -1e-3, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, float("inf"),
                      float("-inf")], device="cuda").view(1, 1, -1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.full_like(g, 1.75, dtype=dtype)
        assert torch.equal(tg.sigmoid_gate_mul(x=x, gate=g.to(dtype)),
                           gate_ref.sigmoid_gate_mul(x=x, gate=g.to(dtype)))
    x64 = torch.randn(2, 3, 5, device="cuda", dtype=torch.float64)
    assert torch.equal(tg.sigmoid_gate_mul(x=x64, gate=x64), gate_ref.sigmoid_gate_mul(x=x64, gate=x64))
    xc = torch.randn(2, 3, 5)
    assert torch.equal(tg.sigmoid_gate_mul(x=xc, gate=xc), gate_ref.sigmoid_gate_mul(x=xc, gate=xc))
    with pytest.raises(ValueError, match="gate must match"):
        tg.sigmoid_gate_mul(x=x64, gate=x64.float())

    gen = torch.Generator(device="cuda").manual_seed(15)
    x = randn(gen, 4, 16, 256, dtype=torch.bfloat16)
    gate = randn(gen, 4, 16, 512, dtype=torch.bfloat16)[..., 256:]
    tg.sigmoid_gate_mul(x=x, gate=gate)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tg.sigmoid_gate_mul(x=x, gate=gate)
    x.mul_(-2)
    gate.add_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gate_ref.sigmoid_gate_mul(x=x, gate=gate))
