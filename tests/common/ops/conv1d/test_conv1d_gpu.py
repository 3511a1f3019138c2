"""Triton causal conv1d (prefill and one-token update) against the reference, on the GPU.

The kernels sum the W taps in the reference's order in fp32 and round once, so outputs agree to
within one rounding of the output dtype (checked as max |diff| <= 1e-6 for fp32 and one bf16
ulp of the value for bf16), and states, which are plain copies of inputs, agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.conv1d import reference as ref

pytestmark = pytest.mark.gpu


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.conv1d import triton as conv_triton

    return conv_triton


def _inputs(lens, d, w=4, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, n = sum(lens), len(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    wide = rand(t, d + 24)
    x = wide[:, 8 : 8 + d]  # rows strided, as a slice of a wider projection output
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return x, rand(d, w), cu, rand(n, d, w - 1)


def _close(got, want, record, name):
    diff = (got.float() - want.float()).abs()
    record(f"{name}.max_abs", diff.max().item())
    if got.dtype == torch.float32:
        assert diff.max().item() <= 1e-5, name
    else:  # one bf16 ulp of the value (8 mantissa bits)
        assert bool((diff <= want.float().abs() * 2**-7 + 1e-6).all()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens,d", [([1, 37, 130, 1000], 8192), ([2], 1000), ([3, 1, 5], 72)])
@pytest.mark.parametrize("with_state", [True, False])
def test_prefill_matches_reference(record_metric, dtype, lens, d, with_state):
    tr = _triton()
    x, w, cu, state = _inputs(lens, d, dtype=dtype)
    state = state if with_state else None
    before = None if state is None else state.clone()
    y, final = tr.causal_conv1d_prefill(x=x, weight=w, cu_seqlens=cu, initial_state=state)
    y_ref, final_ref = ref.causal_conv1d_prefill(x=x, weight=w, cu_seqlens=cu, initial_state=state)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape and final.shape == final_ref.shape
    _close(y, y_ref, record_metric, "y")
    assert torch.equal(final, final_ref)
    if before is not None:
        assert torch.equal(state, before), "initial_state was modified"


def test_prefill_without_activation_and_cuda_cu(record_metric):
    tr = _triton()
    x, w, cu, state = _inputs([5, 17], 300, dtype=torch.float32, seed=1)
    y, final = tr.causal_conv1d_prefill(x=x, weight=w, cu_seqlens=cu.cuda(), initial_state=state,
                                        activation=None)
    y_ref, final_ref = ref.causal_conv1d_prefill(x=x, weight=w, cu_seqlens=cu, initial_state=state,
                                                 activation=None)
    _close(y, y_ref, record_metric, "y")
    assert torch.equal(final, final_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,d", [(1, 8192), (7, 1000), (64, 8192)])
def test_update_matches_reference(record_metric, dtype, n, d):
    tr = _triton()
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, d + 8, generator=gen, device="cuda").to(dtype)[:, 8:]
    w = torch.randn(d, 4, generator=gen, device="cuda").to(dtype)
    state = torch.randn(n, d, 3, generator=gen, device="cuda").to(dtype)
    before = state.clone()
    y, new = tr.causal_conv1d_update(x=x, conv_state=state, weight=w)
    y_ref, new_ref = ref.causal_conv1d_update(x=x, conv_state=state, weight=w)
    _close(y, y_ref, record_metric, "y")
    assert torch.equal(new, new_ref)
    assert torch.equal(state, before), "conv_state was modified"


def test_prefill_then_updates_equal_one_prefill(record_metric):
    """Prefill of a prefix, then token-by-token updates, reproduce one prefill of the whole."""
    tr = _triton()
    x, w, _, state = _inputs([40], 512, dtype=torch.float32, seed=2)
    cu_all = torch.tensor([0, 40])
    y_all, final_all = tr.causal_conv1d_prefill(x=x, weight=w, cu_seqlens=cu_all, initial_state=state)
    y_pre, st = tr.causal_conv1d_prefill(x=x[:30], weight=w, cu_seqlens=torch.tensor([0, 30]),
                                         initial_state=state)
    ys = [y_pre]
    for i in range(30, 40):
        y_i, st = tr.causal_conv1d_update(x=x[i : i + 1], conv_state=st, weight=w)
        ys.append(y_i)
    _close(torch.cat(ys), y_all, record_metric, "y")
    assert torch.equal(st, final_all)


# --- the in-place decode step on the state pool ---

POOL_SLOTS = 50


def _in_place_inputs(n, d, dtype, seed, w=4, padding=0):
    """x rows strided, weight, a 50-slot pool of random windows, and n shuffled live slots
    followed by ``padding`` rows on scratch slot 0 (as a padded CUDA-graph batch has)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x = rand(n + padding, d + 24)[:, 8 : 8 + d]
    live = torch.randperm(POOL_SLOTS - 1, generator=gen, device="cuda")[:n] + 1
    slots = torch.cat([live, torch.zeros(padding, dtype=torch.int64, device="cuda")])
    return x, rand(d, w), rand(POOL_SLOTS, d, w - 1), slots


def _check_in_place(record, y, pool, y_ref, pool_ref, before, slots, n):
    """y and the n live slots against the reference (states exact); other slots but 0 unchanged."""
    live = slots[:n]
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    _close(y[:n], y_ref[:n], record, "y")
    assert torch.equal(pool[live], pool_ref[live]), "written windows differ from the reference"
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[slots] = False
    assert torch.equal(pool[others], before[others]), "a slot outside `slots` was written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [8192, 1000, 72])
@pytest.mark.parametrize("n", [1, 3, 37])
def test_update_in_place_matches_reference(record_metric, dtype, d, n):
    tr = _triton()
    x, w, pool, slots = _in_place_inputs(n, d, dtype, seed=100 + n)
    before, pool_ref = pool.clone(), pool.clone()
    y = tr.conv1d_update_in_place(x=x, conv_pool=pool, slots=slots, weight=w)
    y_ref = ref.conv1d_update_in_place(x=x, conv_pool=pool_ref, slots=slots, weight=w)
    _check_in_place(record_metric, y, pool, y_ref, pool_ref, before, slots, n)


@pytest.mark.parametrize("w", [2, 3, 5])
def test_update_in_place_other_widths_and_padding(record_metric, w):
    tr = _triton()
    x, weight, pool, slots = _in_place_inputs(5, 1000, torch.float32, seed=200 + w, w=w, padding=7)
    before, pool_ref = pool.clone(), pool.clone()
    y = tr.conv1d_update_in_place(x=x, conv_pool=pool, slots=slots, weight=weight, activation=None)
    y_ref = ref.conv1d_update_in_place(x=x, conv_pool=pool_ref, slots=slots, weight=weight, activation=None)
    _check_in_place(record_metric, y, pool, y_ref, pool_ref, before, slots, 5)


def test_update_in_place_replays_in_cuda_graph(record_metric):
    """Captured once; slots, x and the pool changed in place between replays. The last rows are
    padding on scratch slot 0."""
    tr = _triton()
    n, padding, d = 6, 2, 8192
    x, w, pool, slots = _in_place_inputs(n, d, torch.bfloat16, seed=300, padding=padding)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        tr.conv1d_update_in_place(x=x, conv_pool=pool, slots=slots, weight=w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tr.conv1d_update_in_place(x=x, conv_pool=pool, slots=slots, weight=w)
    for replay in range(3):
        new_x, _, new_pool, new_slots = _in_place_inputs(n, d, torch.bfloat16, seed=301 + replay,
                                                         padding=padding)
        x.copy_(new_x)
        pool.copy_(new_pool)
        slots.copy_(new_slots)
        before, pool_ref = pool.clone(), pool.clone()
        graph.replay()
        y_ref = ref.conv1d_update_in_place(x=x, conv_pool=pool_ref, slots=slots, weight=w)
        _check_in_place(record_metric, y, pool, y_ref, pool_ref, before, slots, n)
