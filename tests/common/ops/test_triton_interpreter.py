"""Every Triton kernel of ours against its reference, run by Triton's interpreter on CPU tensors.

The interpreter executes each program of the grid with numpy: it checks a kernel's indexing,
masks, strides and arithmetic order, not what only a GPU shows (compilation, libdevice, races
between programs; the GPU tests cover those). Inputs are fp32 (the interpreter's bf16 casts
truncate instead of rounding), small and of odd sizes, laid out as the model passes them.
Each test first makes the op's reference fail if called, so a backend that fell back to it
cannot pass.

These run where there is no CUDA device, with TRITON_INTERPRET=1 set by ``tests/conftest.py``
before the kernel modules are imported; on a GPU machine the GPU tests run the same kernels.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA machine runs these kernels in the GPU tests instead")

TOL = dict(rtol=2e-5, atol=2e-6)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def backend(monkeypatch, module: str, op: str, reference: str):
    """The Triton ``op`` of ``module``, after making ``reference.op`` raise."""
    ref = importlib.import_module(reference)

    def fell_back(*args, **kwargs):
        raise AssertionError(f"{module}.{op} fell back to the reference")

    monkeypatch.setattr(ref, op, fell_back)
    return getattr(importlib.import_module(module), op)


def reference_op(reference: str, op: str):
    return getattr(importlib.import_module(reference), op)


def clone(args: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in args.items()}


def check(monkeypatch, module, reference, op, args, outputs=(), in_place=()):
    """Run reference and kernel on copies of ``args``; compare return values and the tensors
    named in ``in_place``."""
    want_args, got_args = clone(args), clone(args)
    want = reference_op(reference, op)(**want_args)
    got = backend(monkeypatch, module, op, reference)(**got_args)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, **TOL)
    for name in in_place:
        torch.testing.assert_close(got_args[name], want_args[name], **TOL)


# ---- norms, gates, RoPE, SwiGLU, K/V store -------------------------------------------------

@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm(monkeypatch, zero_centered):
    g = _gen(1)
    x = rand(g, 5, 47)[:, 3:43]  # row-strided view
    check(monkeypatch, "common.ops.norm.triton", "common.ops.norm.reference", "rms_norm",
          dict(x=x, weight=rand(g, 40), eps=1e-6, zero_centered=zero_centered))


def test_add_rms_norm(monkeypatch):
    g = _gen(2)
    check(monkeypatch, "common.ops.norm.triton", "common.ops.norm.reference", "add_rms_norm",
          dict(x=rand(g, 5, 50)[:, :40], residual=rand(g, 5, 40), weight=rand(g, 40), eps=1e-6))


def test_gated_rms_norm(monkeypatch):
    g = _gen(3)
    z = rand(g, 3, 60)[:, 5:53].view(3, 2, 24)
    check(monkeypatch, "common.ops.norm.triton", "common.ops.norm.reference", "gated_rms_norm",
          dict(x=rand(g, 3, 2, 24), gate=z, weight=rand(g, 24), eps=1e-6))


def test_gdn_gating(monkeypatch):
    g = _gen(4)
    ab = rand(g, 5, 20, scale=3.0)
    check(monkeypatch, "common.ops.gdn.gating_triton", "common.ops.gdn.reference", "gdn_gating",
          dict(A_log=rand(g, 6), a=ab[:, :6], dt_bias=rand(g, 6), b=ab[:, 10:16]))


def test_apply_rope(monkeypatch):
    from common.ops.rope.reference import rope_inv_freq

    g = _gen(5)
    qk = rand(g, 5, 6 * 16)
    check(monkeypatch, "common.ops.rope.triton", "common.ops.rope.reference", "apply_rope",
          dict(q=qk[:, :64].view(5, 4, 16), k=qk[:, 64:].view(5, 2, 16),
               positions=torch.tensor([0, 3, 7, 100, 4097]),
               inv_freq=rope_inv_freq(rotary_dim=8, theta=10000.0)))


def test_silu_and_mul(monkeypatch):
    g = _gen(6)
    check(monkeypatch, "common.ops.mlp.triton", "common.ops.mlp.reference", "silu_and_mul",
          dict(x=rand(g, 5, 30)[:, 3:27]))


def test_store_paged_kv(monkeypatch):
    g = _gen(7)
    kv = rand(g, 6, 2, 4, 2, 16)
    check(monkeypatch, "common.ops.attention.kv_store_triton",
          "common.ops.attention.kv_store_reference", "store_paged_kv",
          dict(kv=kv, loc=torch.tensor([5, 22, 0, 9, 13]), k=rand(g, 5, 2, 16),
               v=rand(g, 5, 2, 16)), in_place=("kv",))


def test_qk_norm_rope_store(monkeypatch):
    from common.ops.rope.reference import rope_inv_freq

    g = _gen(8)
    qkv = rand(g, 3, 4 * 32 + 2 * 16 + 2 * 16)
    q = qkv[:, :128].view(3, 4, 32)[..., :16]  # the q half of each [q | gate] head
    check(monkeypatch, "common.ops.attention.qk_prep_triton",
          "common.ops.attention.qk_prep_reference", "qk_norm_rope_store",
          dict(q=q, k=qkv[:, 128:160].view(3, 2, 16), v=qkv[:, 160:].view(3, 2, 16),
               q_weight=rand(g, 16), k_weight=rand(g, 16), eps=1e-6,
               positions=torch.tensor([2, 9, 40]),
               inv_freq=rope_inv_freq(rotary_dim=8, theta=10000.0),
               kv=rand(g, 6, 2, 4, 2, 16), loc=torch.tensor([9, 17, 4])), in_place=("kv",))


def test_sigmoid_gate_mul(monkeypatch):
    g = _gen(9)
    qg = rand(g, 3, 4, 32)
    check(monkeypatch, "common.ops.attention.output_gate_triton",
          "common.ops.attention.output_gate_reference", "sigmoid_gate_mul",
          dict(x=rand(g, 3, 4, 16), gate=qg[..., 16:]))


# ---- causal conv1d -------------------------------------------------------------------------

CONV = "common.ops.conv1d.triton", "common.ops.conv1d.reference"


@pytest.mark.parametrize("with_state", [True, False])
def test_conv1d_prefill(monkeypatch, with_state):
    g = _gen(10)
    args = dict(x=rand(g, 9, 26)[:, 3:23], weight=rand(g, 20, 4), cu_seqlens=torch.tensor([0, 4, 5, 9]),
                initial_state=rand(g, 3, 20, 3) if with_state else None, activation="silu")
    check(monkeypatch, *CONV, "causal_conv1d_prefill", args)


def test_conv1d_update(monkeypatch):
    g = _gen(11)
    check(monkeypatch, *CONV, "causal_conv1d_update",
          dict(x=rand(g, 3, 20), conv_state=rand(g, 3, 20, 3), weight=rand(g, 20, 4)))


def test_conv1d_update_in_place(monkeypatch):
    g = _gen(12)
    check(monkeypatch, *CONV, "conv1d_update_in_place",
          dict(x=rand(g, 3, 20), conv_pool=rand(g, 6, 20, 3), slots=torch.tensor([4, 1, 5]),
               weight=rand(g, 20, 4)), in_place=("conv_pool",))


# ---- Gated DeltaNet ------------------------------------------------------------------------

HK, HV, K, V = 2, 4, 8, 6
CONV_DIM = 2 * HK * K + HV * V


def gdn_tokens(g, t):
    from common.ops.gdn.reference import gdn_gating

    mixed = rand(g, t, 2 * HK * K + HV * V)
    q = mixed[:, :HK * K].view(t, HK, K)
    k = mixed[:, HK * K:2 * HK * K].view(t, HK, K)
    v = mixed[:, 2 * HK * K:].view(t, HV, V)
    gate, beta = gdn_gating(A_log=rand(g, HV, scale=0.5), a=rand(g, t, HV), dt_bias=rand(g, HV),
                            b=rand(g, t, HV))
    return dict(q=q, k=k, v=v, g=gate, beta=beta)


@pytest.mark.parametrize("inter", [False, True])
def test_recurrent_gated_delta_rule(monkeypatch, inter):
    g = _gen(13)
    args = dict(**gdn_tokens(g, 8), cu_seqlens=torch.tensor([0, 3, 4, 8]),
                initial_state=rand(g, 3, HV, V, K, scale=0.3).transpose(-1, -2),
                output_intermediate_states=inter)
    check(monkeypatch, "common.ops.gdn.triton", "common.ops.gdn.reference",
          "recurrent_gated_delta_rule", args)


def test_gdn_decode_in_place(monkeypatch):
    g = _gen(14)
    tokens = gdn_tokens(g, 3)
    ab = rand(g, 3, 2 * HV + 5, scale=3.0)  # raw gates: column views, large enough to saturate
    check(monkeypatch, "common.ops.gdn.triton", "common.ops.gdn.reference", "gdn_decode_in_place",
          dict(q=tokens["q"], k=tokens["k"], v=tokens["v"], a=ab[:, :HV], b=ab[:, HV + 5:],
               A_log=rand(g, HV, scale=0.5), dt_bias=rand(g, HV),
               ssm_pool=rand(g, 6, HV, V, K, scale=0.3), slots=torch.tensor([4, 1, 5])),
          in_place=("ssm_pool",))


# width 4 (every released checkpoint) takes the sliding-window walk, others the tap-by-tap one
@pytest.mark.parametrize("width", [4, 3])
def test_gdn_verify(monkeypatch, width):
    g = _gen(15)
    proj = rand(g, 7, CONV_DIM + 3 + 2 * HV)  # qkv, a, b: column views of one projection
    check(monkeypatch, "common.ops.gdn.verify_triton", "common.ops.gdn.verify_reference",
          "gdn_verify",
          dict(mixed_qkv=proj[:, :CONV_DIM], a=proj[:, CONV_DIM + 3:CONV_DIM + 3 + HV],
               b=proj[:, CONV_DIM + 3 + HV:], cu_seqlens=torch.tensor([0, 4, 7]),
               conv_pool=rand(g, 6, CONV_DIM, width - 1),
               conv_weight=rand(g, CONV_DIM, width, scale=0.5),
               ssm_pool=rand(g, 6, HV, V, K, scale=0.3), slots=torch.tensor([5, 2]),
               A_log=rand(g, HV, scale=0.5), dt_bias=rand(g, HV), num_k_heads=HK,
               num_v_heads=HV))


@pytest.mark.parametrize("width", [4, 3])
def test_gdn_commit_in_place(monkeypatch, width):
    g = _gen(16)
    layers, block = 2, 5
    check(monkeypatch, "common.ops.gdn.commit_triton", "common.ops.gdn.commit_reference",
          "gdn_commit_in_place",
          dict(qkv=rand(g, layers, 3 * block, CONV_DIM), a=rand(g, layers, 3 * block, HV),
               b=rand(g, layers, 3 * block, HV), block=block, accepted=torch.tensor([2, 5, 1]),
               conv_pool=rand(g, layers, 7, CONV_DIM, width - 1),
               conv_weight=rand(g, layers, CONV_DIM, width, scale=0.5),
               ssm_pool=rand(g, layers, 7, HV, V, K, scale=0.3), slots=torch.tensor([6, 2, 3]),
               A_log=rand(g, layers, HV, scale=0.5), dt_bias=rand(g, layers, HV),
               num_k_heads=HK, num_v_heads=HV),
          in_place=("conv_pool", "ssm_pool"))


# ---- DFLASH draft attention ----------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 3)])
def test_draft_block_attention(monkeypatch, causal, window):
    g = _gen(17)
    n, b, h, kvh, d, page = 2, 4, 4, 2, 16, 4
    cache = rand(g, 7, 2, page, kvh, d)
    args = dict(q=rand(g, n, b, h, d), block_k=rand(g, n, b, kvh, d), block_v=rand(g, n, b, kvh, d),
                k_cache=cache[:, 0], v_cache=cache[:, 1],
                page_table=torch.tensor([[3, 5, 1], [6, 0, 0]]), context_lens=[9, 3],
                start_positions=[9, 3], scale=d ** -0.5, causal=causal, sliding_window=window)
    check(monkeypatch, "common.ops.attention.draft_triton", "common.ops.attention.draft_reference",
          "draft_block_attention", args)


# ---- projections --------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
def test_linear(monkeypatch, rows):
    """Both kernels, forced by a tile (the routing sends most of these shapes to cuBLAS)."""
    from common.ops.linear.triton import GemvConfig

    g = _gen(30 + rows)
    # a row-strided input (a column view of a wider projection) and a K that no tile divides
    x, w = rand(g, rows, 120)[:, 7:107], rand(g, 37, 100)
    want = reference_op("common.ops.linear.reference", "linear")(x=x, weight=w)
    triton_linear = backend(monkeypatch, "common.ops.linear.triton", "linear",
                            "common.ops.linear.reference")
    for tile in (GemvConfig(block_n=2, block_k=32), GemvConfig(block_n=16, block_k=64)):
        torch.testing.assert_close(triton_linear(x=x, weight=w, config=tile), want, **TOL)



# ---- MoE ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,experts,top_k,renorm,shared", [
    (1, 30, 3, True, 20), (3, 12, 4, False, 36), (2, 7, 3, True, None), (9, 30, 3, True, 20)])
def test_sparse_moe(monkeypatch, tokens, experts, top_k, renorm, shared):
    """Router, gate/up with SwiGLU and weighted down kernels, against the reference, with a
    shared expert narrower or wider than the routed ones (in the kernels up to 8 tokens, through
    the linear op beyond), or none; the capturable fallback made to fail, so these sizes must
    take the kernels."""
    from common.ops.moe import capturable

    def fell_back(**kwargs):
        raise AssertionError("the Triton MoE fell back to the capturable op")

    monkeypatch.setattr(capturable, "sparse_moe", fell_back)
    g = _gen(60 + tokens)
    hidden, inter = 40, 24
    args = dict(x=rand(g, tokens, hidden), router_weight=rand(g, experts, hidden),
                experts_gate_up=rand(g, experts, 2 * inter, hidden, scale=0.2),
                experts_down=rand(g, experts, hidden, inter, scale=0.2), top_k=top_k,
                norm_topk_prob=renorm)
    if shared is not None:
        args.update(shared_gate_proj=rand(g, shared, hidden, scale=0.2),
                    shared_up_proj=rand(g, shared, hidden, scale=0.2),
                    shared_down_proj=rand(g, hidden, shared, scale=0.2),
                    shared_expert_gate=rand(g, 1, hidden))
    check(monkeypatch, "common.ops.moe.triton", "common.ops.moe.reference", "sparse_moe", args)


@pytest.mark.parametrize("lo,hi", [(0, 10), (10, 20), (20, 30), (4, 11)])
def test_sparse_moe_with_an_expert_offset(monkeypatch, lo, hi):
    """Expert parallelism: a rank's experts ``lo..hi-1`` (routing over all 30), through the
    kernels, give the reference's share of that rank."""
    from common.ops.moe import capturable

    def fell_back(**kwargs):
        raise AssertionError("the Triton MoE fell back to the capturable op")

    monkeypatch.setattr(capturable, "sparse_moe", fell_back)
    g = _gen(70 + lo)
    hidden, inter, tokens = 40, 24, 3
    gate_up = rand(g, 30, 2 * inter, hidden, scale=0.2)
    down = rand(g, 30, hidden, inter, scale=0.2)
    args = dict(x=rand(g, tokens, hidden), router_weight=rand(g, 30, hidden),
                experts_gate_up=gate_up[lo:hi].contiguous(),
                experts_down=down[lo:hi].contiguous(), top_k=3, norm_topk_prob=True,
                expert_offset=lo)
    check(monkeypatch, "common.ops.moe.triton", "common.ops.moe.reference", "sparse_moe", args)
