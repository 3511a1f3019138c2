"""The verify op gives each token the output decoding it would, and leaves the pools alone."""

from __future__ import annotations

import pytest
import torch

from common.ops.conv1d.reference import conv1d_update_in_place
from common.ops.gdn.reference import gdn_decode_in_place
from common.ops.gdn.verify_reference import gdn_verify

HK, HV, K, V, W = 2, 4, 8, 6, 4
CONV_DIM = 2 * HK * K + HV * V


def make(t: int, seed: int, slots_total: int = 9):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return dict(mixed_qkv=rand(t, CONV_DIM), a=rand(t, HV), b=rand(t, HV),
                conv_pool=rand(slots_total, CONV_DIM, W - 1),
                conv_weight=rand(CONV_DIM, W, scale=0.5),
                ssm_pool=rand(slots_total, HV, V, K, scale=0.3), A_log=rand(HV, scale=0.5),
                dt_bias=rand(HV, scale=0.5))


def decoded_outputs(t, slots, lens):
    """Each token through the decode-step references in turn, on copies of the pools."""
    conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
    key_dim = HK * K
    outs, row = [], 0
    for slot, n in zip(slots, lens):
        for _ in range(n):
            x = conv1d_update_in_place(x=t["mixed_qkv"][row:row + 1], conv_pool=conv,
                                       slots=torch.tensor([slot]), weight=t["conv_weight"])
            outs.append(gdn_decode_in_place(
                q=x[:, :key_dim].reshape(1, HK, K), k=x[:, key_dim:2 * key_dim].reshape(1, HK, K),
                v=x[:, 2 * key_dim:].reshape(1, HV, V), a=t["a"][row:row + 1],
                b=t["b"][row:row + 1], A_log=t["A_log"], dt_bias=t["dt_bias"], ssm_pool=ssm,
                slots=torch.tensor([slot])))
            row += 1
    return torch.cat(outs)


@pytest.mark.parametrize("lens", [[5, 1, 3], [4, 4, 4]])
def test_verify_outputs_equal_decoding_and_pools_stay(lens):
    t = make(sum(lens), seed=len(lens) + lens[0])
    slots = [4, 1, 7]
    conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    o = gdn_verify(**{k: v for k, v in t.items() if k not in ("conv_pool", "ssm_pool")},
                   cu_seqlens=cu, conv_pool=conv, ssm_pool=ssm, slots=torch.tensor(slots),
                   num_k_heads=HK, num_v_heads=HV)
    torch.testing.assert_close(o, decoded_outputs(t, slots, lens), rtol=1e-10, atol=1e-12)
    assert torch.equal(conv, t["conv_pool"]) and torch.equal(ssm, t["ssm_pool"])


def test_verify_rejects_bad_shapes():
    t = make(6, seed=0)
    base = dict(t, cu_seqlens=torch.tensor([0, 2, 6]), slots=torch.tensor([1, 2]),
                num_k_heads=HK, num_v_heads=HV)
    for change, match in ((dict(a=t["a"][:, :3]), "a and b"),
                          (dict(cu_seqlens=torch.tensor([0, 6])), "cu_seqlens"),
                          (dict(conv_weight=t["conv_weight"][:-1]), "conv_weight"),
                          (dict(num_k_heads=3), "multiple"),
                          (dict(dt_bias=t["dt_bias"][:2]), "A_log and dt_bias")):
        with pytest.raises(ValueError, match=match):
            gdn_verify(**{**base, **change})
