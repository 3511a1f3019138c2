"""The CPU in-place conv1d update against its reference on fresh random inputs of odd sizes: the
same taps summed in the same order, so output and pool are equal bit for bit; rows not named in
the slots stay as they were, and padding rows may share the scratch slot 0."""

from __future__ import annotations

import pytest
import torch

from common.ops.conv1d import reference, update_cpu

D, SLOTS = 13, 9


def inputs(n, width, *, dtype, pool_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    return rand(n, D), rand(SLOTS, D, width - 1, dt=pool_dtype), rand(D, width)


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float64, torch.float64)])
@pytest.mark.parametrize("width,activation", [(4, "silu"), (3, None), (1, "silu")])
def test_matches_reference_exactly(dtype, pool_dtype, width, activation):
    x, pool, weight = inputs(5, width, dtype=dtype, pool_dtype=pool_dtype, seed=width)
    slots = torch.tensor([7, 2, 5, 1, 8])
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = reference.conv1d_update_in_place(x=x, conv_pool=ref_pool, slots=slots, weight=weight,
                                            activation=activation)
    got = update_cpu.conv1d_update_in_place(x=x, conv_pool=cpu_pool, slots=slots, weight=weight,
                                            activation=activation)
    assert got.dtype == x.dtype
    assert torch.equal(got, want)
    assert torch.equal(cpu_pool, ref_pool)
    assert torch.equal(cpu_pool[[0, 3, 4, 6]], pool[[0, 3, 4, 6]])


def test_padding_rows_on_scratch_slot():
    x, pool, weight = inputs(4, 4, dtype=torch.float32, pool_dtype=torch.float32, seed=5)
    slots = torch.tensor([3, 0, 6, 0])
    ref_pool, cpu_pool = pool.clone(), pool.clone()
    want = reference.conv1d_update_in_place(x=x, conv_pool=ref_pool, slots=slots, weight=weight)
    got = update_cpu.conv1d_update_in_place(x=x, conv_pool=cpu_pool, slots=slots, weight=weight)
    assert torch.equal(got[[0, 2]], want[[0, 2]])
    assert torch.equal(cpu_pool[[3, 6]], ref_pool[[3, 6]])
    assert torch.equal(cpu_pool[[1, 2, 4, 5, 7, 8]], pool[[1, 2, 4, 5, 7, 8]])


def test_caller_mistakes_raise_value_error():
    x, pool, weight = inputs(2, 4, dtype=torch.float32, pool_dtype=torch.float32)
    with pytest.raises(ValueError, match="activation"):
        update_cpu.conv1d_update_in_place(x=x, conv_pool=pool, slots=torch.tensor([1, 2]),
                                          weight=weight, activation="relu")
    with pytest.raises(ValueError, match="conv_pool"):
        update_cpu.conv1d_update_in_place(x=x, conv_pool=pool[..., :2], slots=torch.tensor([1, 2]),
                                          weight=weight)
    with pytest.raises(ValueError, match="slots"):
        update_cpu.conv1d_update_in_place(x=x, conv_pool=pool, slots=torch.tensor([1]),
                                          weight=weight)
