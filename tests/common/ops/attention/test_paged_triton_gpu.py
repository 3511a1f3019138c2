"""On the GPU: our Triton paged attention against the reference (bf16 and fp32, the cases and
head layouts of the FlashInfer tests, a verify block), and its CUDA-graph plans captured once
and replayed for other lengths."""

from __future__ import annotations

import pytest
import torch

from common.ops.attention import reference as ref
from tests.common.compare import cosine, rel_rmse
from tests.common.ops.attention.test_attention_gpu import CASES, PAGE, make_case

pytestmark = pytest.mark.gpu

CASES = {**CASES, "verify": ([3000, 15, 16, 250, 1], [16] * 5)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 4, 256), (16, 2, 256), (8, 2, 128),
                                                     (2, 1, 256)])
def test_triton_matches_reference(record_metric, case, heads, kv_heads, head_dim):
    from common.ops.attention import paged_triton

    prefix, extend = CASES[case]
    inp, _ = make_case(prefix, extend, heads, kv_heads, head_dim=head_dim,
                       seed=len(prefix) + kv_heads)
    got = paged_triton.paged_attention(**inp)
    want = ref.paged_attention(**inp)
    assert got.shape == want.shape and got.dtype == want.dtype
    rm, cs = rel_rmse(got, want), cosine(got, want)
    record_metric("o.rel_rmse", rm)
    record_metric("o.cosine", cs)
    assert rm <= 1e-2 and cs >= 0.9999


def test_triton_fp32_matches_reference_to_fp32_rounding():
    from common.ops.attention import paged_triton

    inp, _ = make_case([40, 0, 7], [16, 33, 1], 6, 2, head_dim=80, dtype=torch.float32, seed=5)
    torch.testing.assert_close(paged_triton.paged_attention(**inp), ref.paged_attention(**inp),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("q_len", [1, 16])
def test_graph_plan_replays_for_new_lengths(q_len):
    """Captured once with one batch's lengths, replayed after plans for others: the eager run of
    the same plan exactly, and the reference within bf16 tolerance."""
    from common.ops.attention.triton_graph import TritonGraphAttention

    batch, heads, kv_heads, head_dim = 5, 16, 4, 256
    lengths_seen = ([q_len + 3, q_len + 900, q_len, q_len + 31, q_len + 4000],
                    [q_len + 2047, q_len + 1, q_len + 64, q_len + 15, q_len + 300])
    longest = max(max(lens) for lens in lengths_seen)
    inp, _ = make_case([longest - q_len] * batch, [q_len] * batch, heads, kv_heads,
                       head_dim=head_dim, seed=q_len)
    q, k_cache, v_cache, table = inp["q"], inp["k_cache"], inp["v_cache"], inp["page_table"]
    plan = TritonGraphAttention(batch_size=batch, q_len=q_len, num_qo_heads=heads,
                                num_kv_heads=kv_heads, head_dim=head_dim, page_size=PAGE,
                                max_pages=table.numel(), dtype=q.dtype, scale=head_dim ** -0.5,
                                device=q.device)

    def plan_for(lengths):
        plan.plan([row[:-(-n // PAGE)].tolist() for row, n in zip(table.cpu(), lengths)],
                  lengths)

    plan_for(lengths_seen[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(q, k_cache, v_cache)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(q, k_cache, v_cache)
    for lengths in lengths_seen:
        plan_for(lengths)
        graph.replay()
        eager = plan.run(q, k_cache, v_cache)
        assert torch.equal(out, eager)
        want = ref.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, page_table=table,
                                   prefix_lens=[n - q_len for n in lengths],
                                   extend_lens=[q_len] * batch, scale=head_dim ** -0.5)
        assert rel_rmse(out, want) <= 1e-2 and cosine(out, want) >= 0.9999
