"""Triton verify commit against its reference on fresh random inputs of odd sizes.

The reference runs on the very same inputs (its arithmetic is fp32, with the conv output rounded
to the io dtype as EXTEND does). Conv windows must be equal (they are copies). States: fp32 io
within relative RMSE 1e-6; bf16 io within the other GDN tests' bf16 rule (relative RMSE 1e-2,
cosine 0.9999), because a conv output that lands on a bf16 rounding boundary can round the other
way after fp32 sums in a different order (a wrong replay is off by O(1)).
"""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import commit_reference as ref
from tests.common.compare import cosine, rel_rmse

pytestmark = pytest.mark.gpu


def make(hk, hv, k, v, w, block, n, dtype, seed, slots_total=13, layers=3):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(layers, *shape, generator=gen, device="cuda") * scale).to(dt)

    conv_dim = 2 * hk * k + hv * v
    rows = n * block + 3
    return dict(qkv=rand(rows, conv_dim), a=rand(rows, hv), b=rand(rows, hv),
                conv_pool=rand(slots_total, conv_dim, w - 1),
                conv_weight=rand(conv_dim, w, scale=0.5),
                ssm_pool=rand(slots_total, hv, v, k, scale=0.3, dt=torch.float32),
                A_log=rand(hv, scale=0.5, dt=torch.float32), dt_bias=rand(hv, scale=0.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hk,hv,k,v,w,block,accepted,slots", [
    (16, 32, 128, 128, 4, 16, [3, 16, 1, 9, 7], [5, 3, 11, 2, 8]),   # Qwen3.5-4B, B = 16
    (16, 32, 128, 128, 4, 8, [8], [12]),
    (3, 6, 64, 96, 4, 5, [2, 5, 1], [4, 9, 1]),
    (2, 2, 32, 32, 3, 7, [7, 4], [6, 10]),
])
def test_triton_commit_matches_reference(record_metric, dtype, hk, hv, k, v, w, block, accepted,
                                         slots):
    from common.ops.gdn import commit_triton as tr

    t = make(hk, hv, k, v, w, block, len(slots), dtype, seed=block + sum(accepted))
    args = dict(qkv=t["qkv"], a=t["a"], b=t["b"], block=block,
                accepted=torch.tensor(accepted, dtype=torch.int32, device="cuda"),
                conv_weight=t["conv_weight"], slots=torch.tensor(slots, device="cuda"),
                A_log=t["A_log"], dt_bias=t["dt_bias"], num_k_heads=hk, num_v_heads=hv)
    conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
    tr.gdn_commit_in_place(**args, conv_pool=conv, ssm_pool=ssm)
    conv_ref, ssm_ref = t["conv_pool"].clone(), t["ssm_pool"].clone()
    ref.gdn_commit_in_place(**args, conv_pool=conv_ref, ssm_pool=ssm_ref)
    assert torch.equal(conv[:, slots], conv_ref[:, slots])
    err = rel_rmse(ssm[:, slots], ssm_ref[:, slots])
    record_metric("commit.ssm_rel_rmse", err)
    if dtype == torch.bfloat16:
        assert err <= 1e-2 and cosine(ssm[:, slots], ssm_ref[:, slots]) >= 0.9999
    else:
        assert err <= 1e-6
    others = [s for s in range(conv.shape[1]) if s not in slots]
    assert torch.equal(conv[:, others], t["conv_pool"][:, others])
    assert torch.equal(ssm[:, others], t["ssm_pool"][:, others])


def test_triton_commit_padding_rows_share_scratch_slot(record_metric):
    """Padding rows (slot 0, one token) leave every live slot as the unpadded commit does."""
    from common.ops.gdn import commit_triton as tr

    t = make(16, 32, 128, 128, 4, 16, 6, torch.bfloat16, seed=3)
    live, lens = [4, 7, 2], [5, 16, 2]
    outs = []
    for slots, accepted in ((live, lens), (live + [0, 0, 0], lens + [1, 1, 1])):
        conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
        tr.gdn_commit_in_place(
            qkv=t["qkv"], a=t["a"], b=t["b"], block=16,
            accepted=torch.tensor(accepted, dtype=torch.int32, device="cuda"),
            conv_pool=conv, conv_weight=t["conv_weight"], ssm_pool=ssm,
            slots=torch.tensor(slots, device="cuda"), A_log=t["A_log"], dt_bias=t["dt_bias"],
            num_k_heads=16, num_v_heads=32)
        outs.append((conv, ssm))
    assert torch.equal(outs[0][0][:, live], outs[1][0][:, live])
    assert torch.equal(outs[0][1][:, live], outs[1][1][:, live])
