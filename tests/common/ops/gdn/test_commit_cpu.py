"""The CPU GDN commit against its reference on fresh random inputs of odd sizes: accepted
prefixes of every length, padding rows on the scratch slot 0, a block longer than one chunk of
the rule, bf16 rows and a bf16 state pool. The conv windows are equal bit for bit; the states
agree to 1e-10 in fp64 (the chunked form against the recurrence) and to fp32 rounding in fp32;
rows not named in the slots stay as they were."""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import commit_cpu, commit_reference

HK, HV, K, V, W, LAYERS, SLOTS = 1, 3, 5, 7, 4, 2, 9
CONV_DIM = 2 * HK * K + HV * V


def inputs(n, block, *, dtype=torch.float64, ssm_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(LAYERS, *shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    rows = n * block + 3
    return dict(qkv=rand(rows, CONV_DIM), a=rand(rows, HV), b=rand(rows, HV), block=block,
                conv_pool=rand(SLOTS, CONV_DIM, W - 1), conv_weight=rand(CONV_DIM, W, scale=0.5),
                ssm_pool=rand(SLOTS, HV, V, K, scale=0.3,
                              dt=ssm_dtype or (torch.float64 if dtype == torch.float64
                                               else torch.float32)),
                A_log=rand(HV, scale=0.5, dt=torch.float32), dt_bias=rand(HV, scale=0.5),
                num_k_heads=HK, num_v_heads=HV)


def both(args, slots, accepted):
    """The pools (conv, ssm) after the reference's commit and after the CPU op's."""
    out = []
    for op in (commit_reference.gdn_commit_in_place, commit_cpu.gdn_commit_in_place):
        conv, ssm = args["conv_pool"].clone(), args["ssm_pool"].clone()
        op(**dict(args, conv_pool=conv, ssm_pool=ssm), slots=torch.tensor(slots),
           accepted=torch.tensor(accepted, dtype=torch.int32))
        out.append((conv, ssm))
    return out


@pytest.mark.parametrize("accepted", [[1, 5, 2], [3, 1, 4], [5, 5, 5], [1, 1, 1]])
def test_fp64_matches_reference(accepted):
    args = inputs(3, 5, seed=sum(accepted))
    slots = [4, 1, 7]
    (conv_want, ssm_want), (conv, ssm) = both(args, slots, accepted)
    assert torch.equal(conv, conv_want)
    torch.testing.assert_close(ssm, ssm_want, rtol=1e-10, atol=1e-12)
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(conv[:, untouched], args["conv_pool"][:, untouched])
    assert torch.equal(ssm[:, untouched], args["ssm_pool"][:, untouched])


def test_padding_rows_on_scratch_slot():
    args = inputs(4, 3, seed=3)
    (conv_want, ssm_want), (conv, ssm) = both(args, [6, 0, 2, 0], [2, 1, 3, 1])
    assert torch.equal(conv[:, [6, 2]], conv_want[:, [6, 2]])
    torch.testing.assert_close(ssm[:, [6, 2]], ssm_want[:, [6, 2]], rtol=1e-10, atol=1e-12)
    assert torch.equal(ssm[:, [1, 3, 4, 5, 7, 8]], args["ssm_pool"][:, [1, 3, 4, 5, 7, 8]])


def test_a_block_longer_than_a_chunk():
    args = inputs(2, 70, seed=4)
    (conv_want, ssm_want), (conv, ssm) = both(args, [3, 5], [70, 66])
    assert torch.equal(conv, conv_want)
    torch.testing.assert_close(ssm, ssm_want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,ssm_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                 (torch.bfloat16, torch.float32, 1e-4),
                                                 (torch.bfloat16, torch.bfloat16, 2e-2)])
def test_low_precision_matches_reference(dtype, ssm_dtype, tol):
    args = inputs(3, 4, dtype=dtype, ssm_dtype=ssm_dtype, seed=5)
    (conv_want, ssm_want), (conv, ssm) = both(args, [8, 2, 5], [4, 2, 3])
    assert torch.equal(conv, conv_want) and ssm.dtype == ssm_dtype
    torch.testing.assert_close(ssm, ssm_want, rtol=tol, atol=tol)


def test_caller_mistakes_raise_value_error():
    args = inputs(2, 3)
    with pytest.raises(ValueError, match="accepted lengths"):
        both(args, [1, 2], [0, 2])
    with pytest.raises(ValueError, match="accepted lengths"):
        both(args, [1, 2], [1, 4])
    with pytest.raises(ValueError, match="a and b"):
        both(dict(args, a=args["a"][..., :2]), [1, 2], [1, 1])
