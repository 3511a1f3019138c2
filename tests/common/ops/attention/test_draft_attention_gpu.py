"""Triton DFLASH draft block attention against the reference, on the GPU.

Caches are laid out as ``DraftKVPool`` lays them out (K and V strided views of one
``[pages, 2, page_size, kv_heads, head_dim]`` tensor), pages are handed out in shuffled order,
page-table rows are padded with the scratch page 0, every cache entry (unused ones too) holds
random values, and q / block k / block v are strided views of one projection, as the model
passes them. Some requests have a block start past their context (context_lens < start).
bf16 inputs are compared with the fp32 reference on the same values (relative RMSE <= 1e-2,
cosine >= 0.9999); fp32 runs its dots in IEEE fp32, so it must agree to fp32 rounding
(relative RMSE <= 1e-5, max |diff| <= 1e-4 of the largest output).
"""

from __future__ import annotations

import pytest
import torch

from common.ops.attention import draft_reference as ref
from tests.common.compare import cosine, rel_rmse

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
PAGE = 16
CONTEXTS = {1: [300], 3: [0, 37, 300], 7: [0, 1, 37, 300, 15, 16, 129]}
MASKS = [(True, None), (False, None), (True, 7), (False, 7)]  # (causal, sliding_window)


def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.attention import draft_triton

    return draft_triton


def _pool_and_table(contexts, starts, b, kv_heads, head_dim, dtype, gen, spare_pages=5):
    """A shuffled page pool covering every request's context; the table also covers the block."""
    need = [-(-(s + b) // PAGE) for s in starts]
    num_pages = sum(need) + spare_pages
    kv = torch.randn(num_pages, 2, PAGE, kv_heads, head_dim, generator=gen,
                     device=DEVICE).to(dtype)
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(len(need))) + 1
    rows, at = [], 0
    for c in need:
        rows.append(order[at : at + c].tolist())
        at += c
    width = max(need) + 1
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32,
                         device=DEVICE)
    return kv, table


def make_case(n, b, heads, kv_heads, head_dim, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    contexts = CONTEXTS[n]
    starts = [c + (3 if i % 3 == 2 else 0) for i, c in enumerate(contexts)]
    kv, table = _pool_and_table(contexts, starts, b, kv_heads, head_dim, dtype, gen)
    width = (heads + 2 * kv_heads) * head_dim
    proj = torch.randn(n * b, width + 8, generator=gen, device=DEVICE).to(dtype)[:, 8:]
    q = proj[:, : heads * head_dim].view(n, b, heads, head_dim)
    k = proj[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, b, kv_heads, head_dim)
    v = proj[:, (heads + kv_heads) * head_dim :].view(n, b, kv_heads, head_dim)
    return dict(q=q, block_k=k, block_v=v, k_cache=kv[:, 0], v_cache=kv[:, 1], page_table=table,
                context_lens=list(contexts), start_positions=starts, scale=head_dim ** -0.5)


def reference_fp32(inp):
    """The reference on the same values widened to fp32, with host lengths."""
    wide = {k: inp[k].float() for k in ("q", "block_k", "block_v", "k_cache", "v_cache")}
    lengths = {k: [int(x) for x in (inp[k].tolist() if torch.is_tensor(inp[k]) else inp[k])]
               for k in ("context_lens", "start_positions")}
    return ref.draft_block_attention(**{**inp, **wide, **lengths})


def check(got, want, dtype, record, name="o"):
    assert got.shape == want.shape
    rm, cs = rel_rmse(got, want), cosine(got, want)
    max_rel = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    record(f"{name}.rel_rmse", rm)
    record(f"{name}.cosine", cs)
    record(f"{name}.max_rel", max_rel)
    if dtype == torch.float32:
        assert rm <= 1e-5 and max_rel <= 1e-4, (rm, max_rel)
    else:
        assert rm <= 1e-2 and cs >= 0.9999, (rm, cs)


@pytest.mark.parametrize("n,b", [(1, 16), (7, 8)])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("head_dim", [128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal,window", MASKS, ids=["causal", "full", "causal_w7", "full_w7"])
def test_triton_matches_reference(record_metric, n, b, heads, kv_heads, head_dim, dtype, causal,
                                  window):
    dt = _triton()
    inp = make_case(n, b, heads, kv_heads, head_dim, dtype,
                    seed=n * 1000 + b * 10 + heads + head_dim)
    inp.update(causal=causal, sliding_window=window)
    k_before = inp["k_cache"].clone()
    got = dt.draft_block_attention(**inp)
    assert got.dtype == dtype
    check(got, reference_fp32(inp), dtype, record_metric)
    # lengths as device tensors (int32 and int64): same kernel, same numbers
    on_device = dict(inp, context_lens=torch.tensor(inp["context_lens"], device=DEVICE),
                     start_positions=torch.tensor(inp["start_positions"], dtype=torch.int32,
                                                  device=DEVICE))
    assert torch.equal(dt.draft_block_attention(**on_device), got)
    assert torch.equal(inp["k_cache"], k_before)


@pytest.mark.parametrize("causal,window", [(False, None), (True, 7)], ids=["full", "causal_w7"])
def test_cuda_graph_replay_with_new_lengths(record_metric, causal, window):
    """One captured call, replayed after the lengths, page table and inputs change in place."""
    dt = _triton()
    n, b, heads, kv_heads, head_dim, dtype = 3, 16, 32, 8, 128, torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    rounds = [([37, 0, 129], [37, 2, 129]), ([300, 1, 16], [300, 1, 20]), ([0, 0, 0], [0, 5, 0])]
    most = [max(r[1][i] for r in rounds) for i in range(n)]
    kv, _ = _pool_and_table(most, most, b, kv_heads, head_dim, dtype, gen, spare_pages=40)
    width = -(-(max(most) + b) // PAGE) + 1
    table = torch.zeros(n, width, dtype=torch.int32, device=DEVICE)
    ctx = torch.zeros(n, dtype=torch.int32, device=DEVICE)
    start = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    q = torch.randn(n, b, heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    bk = torch.randn(n, b, kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    bv = torch.randn(n, b, kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    inp = dict(q=q, block_k=bk, block_v=bv, k_cache=kv[:, 0], v_cache=kv[:, 1], page_table=table,
               context_lens=ctx, start_positions=start, scale=head_dim ** -0.5, causal=causal,
               sliding_window=window)

    def load(round_, seed):
        contexts, starts = round_
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        pages = torch.randperm(kv.shape[0] - 1, generator=torch.Generator().manual_seed(seed)) + 1
        table.copy_(pages[: n * width].view(n, width).to(torch.int32))
        ctx.copy_(torch.tensor(contexts))
        start.copy_(torch.tensor(starts))
        for t in (q, bk, bv):
            t.copy_(torch.randn(t.shape, generator=g, device=DEVICE).to(dtype))

    load(rounds[0], 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        dt.draft_block_attention(**inp)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dt.draft_block_attention(**inp)
    for i, round_ in enumerate(rounds):
        load(round_, i + 1)
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference_fp32(inp), dtype, record_metric, name=f"replay{i}")
        assert torch.equal(out, dt.draft_block_attention(**inp))


def test_unserved_inputs_use_reference():
    """fp64 and mixed dtypes are the reference's; the kernel set resolves to the Triton op."""
    dt = _triton()
    from common.model.kernels import Kernels

    inp = make_case(3, 4, 8, 2, 64, torch.float64, seed=1)
    inp.update(causal=True, sliding_window=None)
    assert torch.equal(dt.draft_block_attention(**inp), ref.draft_block_attention(**inp))
    mixed = dict(inp, q=inp["q"].float(), block_k=inp["block_k"].float(),
                 block_v=inp["block_v"].float(), k_cache=inp["k_cache"].bfloat16())
    assert torch.equal(dt.draft_block_attention(**mixed), ref.draft_block_attention(**mixed))
    kernels = Kernels.select(backends={"draft_block_attention": "triton"})
    assert kernels.draft_block_attention is dt.draft_block_attention
