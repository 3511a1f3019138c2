import pytest
import torch
import torch.nn.functional as F

from common.ops.conv1d.reference import causal_conv1d_prefill, causal_conv1d_update, conv1d_update_in_place

D, W = 11, 4


def _rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("activation", ["silu", None])
def test_prefill_equals_loop_of_updates(activation):
    gen = torch.Generator().manual_seed(0)
    lens = [1, 2, 9, 5]  # the first two are shorter than W - 1
    x = _rand(gen, sum(lens), D)
    weight = _rand(gen, D, W)
    init = _rand(gen, len(lens), D, W - 1)
    init_copy = init.clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y, final = causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=cu, initial_state=init, activation=activation)
    assert y.shape == x.shape and final.shape == init.shape
    assert torch.equal(init, init_copy)
    for r, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        state = init[r : r + 1]
        for t in range(start, end):
            old, old_copy = state, state.clone()
            y_t, state = causal_conv1d_update(x=x[t : t + 1], conv_state=old, weight=weight, activation=activation)
            assert torch.equal(old, old_copy)  # functional: the passed state is not written
            torch.testing.assert_close(y_t[0], y[t], rtol=0, atol=1e-14)
        torch.testing.assert_close(state[0], final[r], rtol=0, atol=0)


def test_short_sequences_keep_older_history():
    gen = torch.Generator().manual_seed(1)
    x = _rand(gen, 3, D)
    weight = _rand(gen, D, W)
    init = _rand(gen, 2, D, W - 1)
    cu = torch.tensor([0, 1, 3])
    _, final = causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=cu, initial_state=init)
    torch.testing.assert_close(final[0], torch.cat([init[0, :, 1:], x[0:1].T], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(final[1], torch.cat([init[1, :, 2:], x[1:3].T], dim=1), rtol=0, atol=0)
    _, final0 = causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=cu)
    torch.testing.assert_close(final0[0], torch.cat([torch.zeros(D, 2, dtype=x.dtype), x[0:1].T], dim=1))


def test_matches_torch_conv1d_without_initial_state():
    gen = torch.Generator().manual_seed(2)
    x = _rand(gen, 17, D, dtype=torch.float32)
    weight = _rand(gen, D, W, dtype=torch.float32)
    y, final = causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=torch.tensor([0, 17]))
    expected = F.silu(F.conv1d(x.T[None], weight[:, None], padding=W - 1, groups=D)[0, :, :17].T)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final[0], x[-(W - 1) :].T, rtol=0, atol=0)


def test_dtypes_follow_inputs():
    gen = torch.Generator().manual_seed(3)
    x = _rand(gen, 6, D, dtype=torch.bfloat16)
    weight = _rand(gen, D, W, dtype=torch.bfloat16)
    y, final = causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=torch.tensor([0, 2, 6]))
    assert y.dtype == final.dtype == torch.bfloat16
    y1, state = causal_conv1d_update(x=x[:2], conv_state=final, weight=weight)
    assert y1.dtype == state.dtype == torch.bfloat16 and state.shape == (2, D, W - 1)


def test_caller_mistakes_raise_value_error():
    x, weight = torch.randn(5, D), torch.randn(D, W)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=torch.tensor([0, 5]), activation="gelu")
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_prefill(x=x, weight=weight, cu_seqlens=torch.tensor([0, 5]), initial_state=torch.randn(1, D, W))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x=x[:2], conv_state=torch.randn(2, D, W), weight=weight)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_update(x=x[:2], conv_state=torch.randn(2, D, W - 1), weight=torch.randn(D + 1, W))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_update_in_place_equals_update_on_gathered_rows(dtype, activation):
    gen = torch.Generator().manual_seed(4)
    num_slots, n = 9, 4
    x = _rand(gen, n, D + 3, dtype=dtype)[:, 3:]  # strided rows
    weight = _rand(gen, D, W, dtype=dtype)
    pool = _rand(gen, num_slots, D, W - 1, dtype=dtype)
    slots = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    before = pool.clone()
    y = conv1d_update_in_place(x=x, conv_pool=pool, slots=slots, weight=weight, activation=activation)
    y_want, s_want = causal_conv1d_update(x=x, conv_state=before[slots], weight=weight, activation=activation)
    assert y.dtype == dtype
    torch.testing.assert_close(y, y_want, rtol=0, atol=0)
    torch.testing.assert_close(pool[slots], s_want, rtol=0, atol=0)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_update_in_place_padding_rows_on_scratch_slot():
    gen = torch.Generator().manual_seed(5)
    x, weight, pool = _rand(gen, 4, D), _rand(gen, D, W), _rand(gen, 5, D, W - 1)
    slots = torch.tensor([3, 0, 1, 0])
    before = pool.clone()
    y = conv1d_update_in_place(x=x, conv_pool=pool, slots=slots, weight=weight)
    y_want, s_want = causal_conv1d_update(x=x[[0, 2]], conv_state=before[[3, 1]], weight=weight)
    # another batch size vectorises differently: equal to within fp64 rounding
    torch.testing.assert_close(y[[0, 2]], y_want, rtol=0, atol=1e-14)
    torch.testing.assert_close(pool[[3, 1]], s_want, rtol=0, atol=0)
    assert torch.equal(pool[[2, 4]], before[[2, 4]])


def test_update_in_place_caller_mistakes_raise_value_error():
    x, weight, pool = torch.randn(2, D), torch.randn(D, W), torch.randn(4, D, W - 1)
    with pytest.raises(ValueError, match="conv_pool"):
        conv1d_update_in_place(x=x, conv_pool=torch.randn(4, D, W), slots=torch.tensor([1, 2]), weight=weight)
    with pytest.raises(ValueError, match="slots"):
        conv1d_update_in_place(x=x, conv_pool=pool, slots=torch.tensor([1]), weight=weight)
    with pytest.raises(ValueError, match="activation"):
        conv1d_update_in_place(x=x, conv_pool=pool, slots=torch.tensor([1, 2]), weight=weight, activation="relu")
