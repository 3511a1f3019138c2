"""Triton GDN verify against its reference on fresh random inputs of odd sizes.

Both run on the same inputs (fp32 arithmetic, the conv output rounded to the io dtype). Outputs:
fp32 io within max relative error 1e-4 (the rule of the other Triton recurrence tests); bf16 io within relative RMSE 1e-2 and cosine 0.9999 (a
conv output on a bf16 rounding boundary can round the other way after fp32 sums in a different
order). The pools must be left exactly as they were.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import verify_reference as ref
from tests.common.compare import cosine, rel_rmse

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hk,hv,k,v,w,lens,slots", [
    (16, 32, 128, 128, 4, [16, 16, 16], [5, 3, 11]),     # Qwen3.5-4B, B = 16
    (16, 32, 128, 128, 4, [8, 8, 8, 8, 8], [9, 0, 0, 0, 0]),  # padding rows share slot 0
    (3, 6, 64, 96, 4, [5, 2, 7], [4, 9, 1]),
    (2, 2, 32, 32, 3, [1], [6]),
])
def test_triton_verify_matches_reference(record_metric, dtype, hk, hv, k, v, w, lens, slots):
    from common.ops.gdn import verify_triton as tr

    gen = torch.Generator(device="cuda").manual_seed(sum(lens) + hv)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dt)

    conv_dim, t = 2 * hk * k + hv * v, sum(lens)
    # the model's layout: qkv, a and b are column views of one projection output
    proj = rand(t, conv_dim + 5 + 2 * hv)
    args = dict(mixed_qkv=proj[:, :conv_dim], a=proj[:, conv_dim + 5:conv_dim + 5 + hv],
                b=proj[:, conv_dim + 5 + hv:],
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda"),
                conv_pool=rand(13, conv_dim, w - 1), conv_weight=rand(conv_dim, w, scale=0.5),
                ssm_pool=rand(13, hv, v, k, scale=0.3, dt=torch.float32),
                slots=torch.tensor(slots, device="cuda"), A_log=rand(hv, scale=0.5, dt=torch.float32),
                dt_bias=rand(hv, scale=0.5), num_k_heads=hk, num_v_heads=hv)
    conv0, ssm0 = args["conv_pool"].clone(), args["ssm_pool"].clone()
    o = tr.gdn_verify(**args)
    torch.cuda.synchronize()
    assert torch.equal(args["conv_pool"], conv0) and torch.equal(args["ssm_pool"], ssm0)
    want = ref.gdn_verify(**args)
    err = rel_rmse(o, want)
    record_metric("verify.o_rel_rmse", err)
    if dtype == torch.float32:
        assert ((o - want).abs().max() / want.abs().max()).item() <= 1e-4
    else:
        assert err <= 1e-2 and cosine(o, want) >= 0.9999


def test_triton_verify_replays_in_a_cuda_graph():
    """Captured once, the verify reads new rows, lengths and slots written in place."""
    from common.ops.gdn import verify_triton as tr

    gen = torch.Generator(device="cuda").manual_seed(7)
    hk, hv, k, v, w, b = 16, 32, 128, 128, 4, 8
    conv_dim = 2 * hk * k + hv * v

    def rand(*shape, scale=1.0, dt=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dt)

    args = dict(mixed_qkv=rand(2 * b, conv_dim), a=rand(2 * b, hv), b=rand(2 * b, hv),
                cu_seqlens=torch.tensor([0, b, 2 * b], device="cuda"),
                conv_pool=rand(9, conv_dim, w - 1), conv_weight=rand(conv_dim, w, scale=0.5),
                ssm_pool=rand(9, hv, v, k, scale=0.3, dt=torch.float32),
                slots=torch.tensor([3, 5], device="cuda"),
                A_log=rand(hv, scale=0.5, dt=torch.float32), dt_bias=rand(hv, scale=0.5),
                num_k_heads=hk, num_v_heads=hv)
    tr.gdn_verify(**args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tr.gdn_verify(**args)
    args["mixed_qkv"].copy_(rand(2 * b, conv_dim))
    args["slots"].copy_(torch.tensor([7, 2], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = ref.gdn_verify(**args)
    assert rel_rmse(out, want) <= 1e-2 and cosine(out, want) >= 0.9999
