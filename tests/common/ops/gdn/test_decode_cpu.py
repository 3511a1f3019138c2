"""The CPU in-place GDN decode step against its reference on fresh random inputs of odd sizes.

fp64 inputs agree to 1e-12 (the same math, summed in another order); fp32 to 1e-5 relative
(fp32 rounding); bf16 inputs give a bf16 output within one bf16 rounding. Rows not named in
the slots stay as they were, padding rows may share the scratch slot 0, and a bf16 pool is
read and written in its own dtype as the reference does.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import decode_cpu, reference

V_DIM, K_DIM, SLOTS = 7, 5, 11


def inputs(n, hk, hv, *, dtype=torch.float32, pool_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    step = dict(q=rand(n, hk, K_DIM), k=rand(n, hk, K_DIM), v=rand(n, hv, V_DIM),
                a=rand(n, hv), b=rand(n, hv), A_log=rand(hv, scale=0.5, dt=torch.float32),
                dt_bias=rand(hv, scale=0.5))
    pool = rand(SLOTS, hv, V_DIM, K_DIM, scale=0.3, dt=pool_dtype)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1  # shuffled, never slot 0
    return step, pool, slots


def both(step, pool, slots, **kw):
    """(output, pool) of the reference and of the CPU op, each on its own copy of the pool."""
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    ref = reference.gdn_decode_in_place(**step, ssm_pool=ref_pool, slots=slots, **kw)
    cpu = decode_cpu.gdn_decode_in_place(**step, ssm_pool=cpu_pool, slots=slots, **kw)
    return (ref, ref_pool), (cpu, cpu_pool)


@pytest.mark.parametrize("n,hk,hv", [(1, 1, 1), (3, 3, 3), (5, 2, 6), (9, 1, 3)])
def test_fp64_matches_reference(n, hk, hv):
    step, pool, slots = inputs(n, hk, hv, dtype=torch.float64, pool_dtype=torch.float64, seed=n)
    (o_ref, pool_ref), (o, pool_cpu) = both(step, pool, slots)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool_cpu, pool_ref, rtol=1e-12, atol=1e-12)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool_cpu[untouched], pool[untouched])


@pytest.mark.parametrize("scale,l2", [(None, True), (0.3, False)])
def test_fp32_matches_reference_to_rounding(scale, l2):
    step, pool, slots = inputs(6, 2, 4, seed=3)
    (o_ref, pool_ref), (o, pool_cpu) = both(step, pool, slots, scale=scale, use_qk_l2norm=l2)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool_cpu, pool_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_bf16_inputs_and_padding_rows_on_scratch_slot(pool_dtype):
    step, pool, _ = inputs(5, 1, 3, dtype=torch.bfloat16, pool_dtype=pool_dtype, seed=7)
    slots = torch.tensor([4, 0, 2, 0, 0])
    (o_ref, pool_ref), (o, pool_cpu) = both(step, pool, slots)
    assert o.dtype == torch.bfloat16 and pool_cpu.dtype == pool_dtype
    live = [0, 2]
    torch.testing.assert_close(o[live], o_ref[live], rtol=1e-2, atol=1e-2)
    tol = 1e-5 if pool_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(pool_cpu[[4, 2]], pool_ref[[4, 2]], rtol=tol, atol=tol)
    others = [1, 3, 5, 6, 7, 8, 9, 10]
    assert torch.equal(pool_cpu[others], pool[others])


def test_far_out_gates_match_reference():
    """Decays of e**-90 and write strengths of sigmoid(-95) (subnormal in fp32), which the op
    takes as 0 (``NEGLIGIBLE``), give the reference's numbers."""
    step, pool, slots = inputs(4, 2, 2, seed=9)
    step["A_log"] = torch.zeros_like(step["A_log"])
    step["a"][:, 0] = 90.0  # g = -softplus(90 + dt_bias): about -90
    step["b"][:, 1] = -95.0
    (o_ref, pool_ref), (o, pool_cpu) = both(step, pool, slots)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool_cpu, pool_ref, rtol=1e-5, atol=1e-6)


def test_caller_mistakes_raise_value_error():
    step, pool, slots = inputs(3, 2, 4, seed=12)
    with pytest.raises(ValueError, match="ssm_pool"):
        decode_cpu.gdn_decode_in_place(**step, ssm_pool=pool.transpose(-1, -2), slots=slots)
    with pytest.raises(ValueError, match="slots"):
        decode_cpu.gdn_decode_in_place(**step, ssm_pool=pool, slots=slots[:2])
    with pytest.raises(ValueError, match="a and b"):
        decode_cpu.gdn_decode_in_place(**dict(step, b=step["b"][:, :1]), ssm_pool=pool,
                                       slots=slots)
