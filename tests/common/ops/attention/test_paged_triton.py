"""common/ops/attention/paged_triton.py and triton_graph.py against the reference paged attention,
run by Triton's interpreter on CPU tensors (fp32, odd sizes, pages shuffled): decode, verify,
chunked prefill and long extends, one key slice and several, and graph plans made again for
other lengths. The GPU tests run the same kernels compiled (test_paged_triton_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

from common.ops.attention import reference

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA machine runs these kernels in the GPU tests instead")

TOL = dict(rtol=2e-5, atol=2e-6)


def _case(seed: int, prefix, extend, *, heads=6, kv_heads=2, head_dim=24, page=5):
    """(q, k_cache, v_cache, page_table): each request's pages a random choice of the pool's."""
    g = torch.Generator().manual_seed(seed)
    widest = max(-(-(p + e) // page) for p, e in zip(prefix, extend)) + 1
    pages = len(prefix) * widest + 3
    table = torch.randperm(pages, generator=g)[:len(prefix) * widest].view(len(prefix), widest)
    cache = torch.randn(2, pages, page, kv_heads, head_dim, generator=g)
    q = torch.randn(sum(extend), heads, head_dim, generator=g)
    return q, cache[0], cache[1], table.to(torch.int32)


@pytest.fixture
def no_reference(monkeypatch):
    """The Triton op, with the reference made to fail if the op fell back to it."""
    from common.ops.attention import paged_triton

    want = reference.paged_attention

    def fell_back(**kwargs):
        raise AssertionError("paged_triton fell back to the reference")

    monkeypatch.setattr(reference, "paged_attention", fell_back)
    return paged_triton, want


@pytest.mark.parametrize("prefix,extend,heads,kv_heads,splits", [
    ([7, 0, 30], [1, 1, 1], 6, 2, None),   # decode
    ([7, 0, 30], [1, 1, 1], 6, 2, 3),      # decode, keys in three slices
    ([11, 3], [5, 5], 8, 2, 4),            # verify of a block of 5, slices mostly empty
    ([0, 9, 4], [37, 70, 1], 6, 2, None),  # prefill, chunked prefill and a decode together
    ([3], [130], 4, 4, None),              # a long extend: items of 64 queries
])
def test_paged_attention_matches_the_reference(no_reference, monkeypatch, prefix, extend,
                                               heads, kv_heads, splits):
    paged_triton, want_op = no_reference
    if splits is not None:
        monkeypatch.setattr(paged_triton, "splits_for", lambda *a, **k: splits)
    q, k_cache, v_cache, table = _case(len(extend), prefix, extend, heads=heads,
                                       kv_heads=kv_heads)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table, prefix_lens=prefix,
                extend_lens=extend, scale=0.3)
    torch.testing.assert_close(paged_triton.paged_attention(**args), want_op(**args), **TOL)


def test_paged_attention_keeps_the_reference_argument_checks(no_reference):
    paged_triton, _ = no_reference
    q, k_cache, v_cache, table = _case(0, [4], [2])
    with pytest.raises(ValueError, match="sum"):
        paged_triton.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table,
                                     prefix_lens=[4], extend_lens=[3], scale=1.0)


@pytest.mark.parametrize("q_len,splits", [(1, None), (1, 2), (4, 3)])
def test_graph_plans_match_the_reference_and_plan_again(no_reference, monkeypatch, q_len,
                                                         splits):
    paged_triton, want_op = no_reference
    from common.ops.attention.triton_graph import TritonGraphAttention

    if splits is not None:
        monkeypatch.setattr(paged_triton, "splits_for", lambda *a, **k: splits)
    page, batch = 5, 3
    q, k_cache, v_cache, table = _case(9, [40] * batch, [q_len] * batch, page=page)
    plan = TritonGraphAttention(batch_size=batch, q_len=q_len, num_qo_heads=6, num_kv_heads=2,
                                head_dim=24, page_size=page, max_pages=table.numel(),
                                dtype=torch.float32, scale=0.3, device=torch.device("cpu"))
    # the same plan object, planned for one batch's lengths and then for another's
    for lengths in ([q_len + 6, q_len + 40, q_len], [q_len + 33, q_len + 1, q_len + 17]):
        pages = [row[:-(-n // page)].tolist() for row, n in zip(table, lengths)]
        plan.plan(pages, lengths)
        want = want_op(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table,
                       prefix_lens=[n - q_len for n in lengths], extend_lens=[q_len] * batch,
                       scale=0.3)
        torch.testing.assert_close(plan.run(q, k_cache, v_cache), want, **TOL)


def test_a_plan_moved_on_the_device_is_the_plan_of_its_lengths(no_reference):
    """Planned for the longest lengths the rows may reach, then each row cut to its own by a
    device ``advance`` (the first two rows; the third, padding, keeps its plan)."""
    paged_triton, want_op = no_reference
    from common.ops.attention.triton_graph import TritonGraphAttention

    page, batch, q_len = 5, 3, 4
    q, k_cache, v_cache, table = _case(11, [40] * batch, [q_len] * batch, page=page)
    plan = TritonGraphAttention(batch_size=batch, q_len=q_len, num_qo_heads=6, num_kv_heads=2,
                                head_dim=24, page_size=page, max_pages=table.numel(),
                                dtype=torch.float32, scale=0.3, device=torch.device("cpu"))
    longest = [20 + 2 * q_len, 3 + 2 * q_len, 9]
    plan.plan([row[:-(-n // page)].tolist() for row, n in zip(table, longest)], longest)
    plan.advance(2, torch.tensor([1 - q_len, 3 - q_len, 99]))  # committed 1 and 3 of 4
    lengths = [20 + q_len + 1, 3 + q_len + 3, 9]
    want = want_op(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table,
                   prefix_lens=[n - q_len for n in lengths], extend_lens=[q_len] * batch,
                   scale=0.3)
    torch.testing.assert_close(plan.run(q, k_cache, v_cache), want, **TOL)


def test_graph_plans_refuse_what_they_cannot_hold():
    from common.ops.attention.triton_graph import TritonGraphAttention

    plan = TritonGraphAttention(batch_size=2, q_len=2, num_qo_heads=4, num_kv_heads=2,
                                head_dim=16, page_size=4, max_pages=3, dtype=torch.float32,
                                scale=1.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="2 rows"):
        plan.plan([[0]], [2])
    with pytest.raises(ValueError, match="q_len"):
        plan.plan([[0], [1]], [2, 1])
    with pytest.raises(ValueError, match="exceed"):
        plan.plan([[0, 1], [2, 0]], [8, 5])
    with pytest.raises(ValueError, match="head dim"):
        TritonGraphAttention(batch_size=1, q_len=1, num_qo_heads=2, num_kv_heads=1,
                             head_dim=512, page_size=4, max_pages=3, dtype=torch.float32,
                             scale=1.0, device=torch.device("cpu"))
