"""The CPU GDN verify against its reference on fresh random inputs of odd sizes: blocks of one
length and of several (one empty), padding rows sharing the scratch slot 0, a block longer than
one chunk of the rule, bf16 rows and a bf16 state pool. fp64 agrees to 1e-10 (the chunked form
against the recurrence), fp32 to fp32 rounding; the pools are left exactly as they were."""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import verify_cpu, verify_reference

HK, HV, K, V, W, SLOTS = 2, 6, 5, 7, 4, 9
CONV_DIM = 2 * HK * K + HV * V


def inputs(lens, slots, *, dtype=torch.float64, ssm_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    t = sum(lens)
    # the model's layout: qkv, a and b are column views of one projection output
    proj = rand(t, CONV_DIM + 3 + 2 * HV)
    return dict(mixed_qkv=proj[:, :CONV_DIM], a=proj[:, CONV_DIM + 3:CONV_DIM + 3 + HV],
                b=proj[:, CONV_DIM + 3 + HV:],
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()),
                conv_pool=rand(SLOTS, CONV_DIM, W - 1), conv_weight=rand(CONV_DIM, W, scale=0.5),
                ssm_pool=rand(SLOTS, HV, V, K, scale=0.3,
                              dt=ssm_dtype or (torch.float64 if dtype == torch.float64
                                               else torch.float32)),
                slots=torch.tensor(slots), A_log=rand(HV, scale=0.5, dt=torch.float32),
                dt_bias=rand(HV, scale=0.5), num_k_heads=HK, num_v_heads=HV)


def check(args, tol):
    conv0, ssm0 = args["conv_pool"].clone(), args["ssm_pool"].clone()
    got = verify_cpu.gdn_verify(**args)
    assert torch.equal(args["conv_pool"], conv0) and torch.equal(args["ssm_pool"], ssm0)
    want = verify_reference.gdn_verify(**args)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("lens,slots", [([5, 5, 5], [4, 1, 7]),
                                        ([3, 1, 6], [2, 8, 5]),
                                        ([4, 0, 2], [3, 6, 1]),
                                        ([4, 4, 4, 4], [5, 0, 0, 0])])  # padding rows on slot 0
def test_fp64_matches_reference(lens, slots):
    check(inputs(lens, slots, seed=sum(lens)), 1e-10)


def test_a_block_longer_than_a_chunk():
    check(inputs([70, 3], [6, 2], seed=1), 1e-10)


@pytest.mark.parametrize("dtype,ssm_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                 (torch.bfloat16, torch.float32, 2e-2),
                                                 (torch.bfloat16, torch.bfloat16, 2e-2)])
def test_low_precision_matches_reference(dtype, ssm_dtype, tol):
    check(inputs([6, 2, 6], [1, 3, 8], dtype=dtype, ssm_dtype=ssm_dtype, seed=2), tol)


def test_caller_mistakes_raise_value_error():
    args = inputs([2, 2], [1, 2])
    with pytest.raises(ValueError, match="cu_seqlens"):
        verify_cpu.gdn_verify(**dict(args, cu_seqlens=torch.tensor([0, 3, 2])))
    with pytest.raises(ValueError, match="cu_seqlens"):
        verify_cpu.gdn_verify(**dict(args, cu_seqlens=torch.tensor([0, 4])))
    with pytest.raises(ValueError, match="conv_pool"):
        verify_cpu.gdn_verify(**dict(args, conv_pool=args["conv_pool"][..., :2]))
