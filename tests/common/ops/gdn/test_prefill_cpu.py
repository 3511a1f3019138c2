"""The CPU chunked GDN prefill against the reference on fresh random inputs of odd sizes:
sequences of several lengths in one batch (empty, one token, under a chunk, over two chunks,
the longest not first), GQA heads, with and without an initial state, with and without the
q/k l2norm, other chunk sizes. fp64 agrees to 1e-10, fp32 to 1e-5, bf16 inputs to a bf16
rounding of the output; the initial state is left exactly as it was, and the caller's mistakes
raise the reference's ValueErrors."""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import prefill_cpu, reference

HK, HV, K, V = 2, 6, 5, 7
MIXED = [3, 0, 150, 1, 40, 64, 0]  # over two chunks, not first; empty; one token; < a chunk


def inputs(lens, *, dtype=torch.float64, state=True, seed=0, hk=HK, hv=HV):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    t, n = sum(lens), len(lens)
    g = -torch.nn.functional.softplus(torch.randn(t, hv, generator=gen, dtype=torch.float64))
    return dict(q=rand(t, hk, K), k=rand(t, hk, K), v=rand(t, hv, V), g=g.to(dtype),
                beta=torch.rand(t, hv, generator=gen, dtype=torch.float64).to(dtype),
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()),
                initial_state=rand(n, hv, K, V, scale=0.3) if state else None)


def check(args, tol, **options):
    state0 = None if args["initial_state"] is None else args["initial_state"].clone()
    o, s = prefill_cpu.chunk_gated_delta_rule(**args, **options)
    if state0 is not None:
        assert torch.equal(args["initial_state"], state0)
    want_o, want_s = reference.chunk_gated_delta_rule(**args, **options)
    assert o.shape == want_o.shape and o.dtype == want_o.dtype
    assert s.shape == want_s.shape and s.dtype == want_s.dtype
    torch.testing.assert_close(o, want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(s, want_s, rtol=tol, atol=tol)


@pytest.mark.parametrize("lens", [MIXED, [9, 9, 9], [130], [0, 0], [1]])
@pytest.mark.parametrize("state", [True, False])
def test_fp64_matches_reference(lens, state):
    check(inputs(lens, state=state, seed=sum(lens)), 1e-10)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("heads", [(2, 6), (3, 3), (1, 4)])
def test_heads_and_l2norm(l2norm, heads):
    args = inputs([20, 70, 0, 5], seed=3, hk=heads[0], hv=heads[1])
    check(args, 1e-10, use_qk_l2norm=l2norm, scale=0.7)


@pytest.mark.parametrize("chunk_size", [1, 16, 100])
def test_other_chunk_sizes(chunk_size):
    check(inputs(MIXED, seed=5), 1e-10, chunk_size=chunk_size)


def test_fp32_matches_reference():
    check(inputs(MIXED, dtype=torch.float32, seed=7), 1e-5)


def test_bf16_inputs():
    args = inputs(MIXED, dtype=torch.bfloat16, seed=8)
    args["initial_state"] = args["initial_state"].float()
    check(args, 2e-2)


def test_caller_mistakes_raise_as_the_reference():
    good = inputs([4, 3], seed=9)
    bad = [dict(chunk_size=0),
           dict(cu_seqlens=torch.tensor([0, 5, 6])),  # does not end at T
           dict(cu_seqlens=torch.tensor([0, 5, 3, 7])),  # falls
           dict(cu_seqlens=torch.tensor([0.0, 7.0])),
           dict(initial_state=torch.zeros(2, HV, V, K)),  # V-major
           dict(g=good["g"][:, :3]),
           dict(v=good["v"][:, :5])]  # HV not a multiple of HK
    for change in bad:
        args = {**good, **change}
        with pytest.raises(ValueError):
            reference.chunk_gated_delta_rule(**args)
        with pytest.raises(ValueError):
            prefill_cpu.chunk_gated_delta_rule(**args)
