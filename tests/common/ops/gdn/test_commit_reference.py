"""The verify commit replays the accepted prefix: the same slot as decoding those tokens one by one."""

from __future__ import annotations

import pytest
import torch

from common.ops.conv1d.reference import conv1d_update_in_place
from common.ops.gdn.commit_reference import gdn_commit_in_place
from common.ops.gdn.reference import gdn_decode_in_place

HK, HV, K, V, W, BLOCK, LAYERS = 2, 4, 8, 6, 4, 5, 3
CONV_DIM = 2 * HK * K + HV * V


def make(n: int, slots_total: int = 9, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(LAYERS, *shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    rows = n * BLOCK + 3
    return dict(
        qkv=rand(rows, CONV_DIM), a=rand(rows, HV), b=rand(rows, HV),
        conv_pool=rand(slots_total, CONV_DIM, W - 1), conv_weight=rand(CONV_DIM, W, scale=0.5),
        ssm_pool=rand(slots_total, HV, V, K, scale=0.3), A_log=rand(HV, scale=0.5),
        dt_bias=rand(HV, scale=0.5))


def decode_one_by_one(t, slots, accepted):
    """Each request's accepted tokens through the decode-step references, one step at a time,
    layer by layer."""
    conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
    key_dim = HK * K
    for layer in range(LAYERS):
        for r, (slot, j) in enumerate(zip(slots, accepted)):
            for i in range(j):
                row = slice(r * BLOCK + i, r * BLOCK + i + 1)
                x = conv1d_update_in_place(x=t["qkv"][layer, row], conv_pool=conv[layer],
                                           slots=torch.tensor([slot]),
                                           weight=t["conv_weight"][layer])
                q = x[:, :key_dim].reshape(1, HK, K)
                k = x[:, key_dim:2 * key_dim].reshape(1, HK, K)
                v = x[:, 2 * key_dim:].reshape(1, HV, V)
                gdn_decode_in_place(q=q, k=k, v=v, a=t["a"][layer, row], b=t["b"][layer, row],
                                    A_log=t["A_log"][layer], dt_bias=t["dt_bias"][layer],
                                    ssm_pool=ssm[layer], slots=torch.tensor([slot]))
    return conv, ssm


def commit(t, slots, accepted):
    conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
    gdn_commit_in_place(qkv=t["qkv"], a=t["a"], b=t["b"], block=BLOCK,
                        accepted=torch.tensor(accepted), conv_pool=conv,
                        conv_weight=t["conv_weight"], ssm_pool=ssm, slots=torch.tensor(slots),
                        A_log=t["A_log"], dt_bias=t["dt_bias"], num_k_heads=HK, num_v_heads=HV)
    return conv, ssm


@pytest.mark.parametrize("accepted", [[1, 5, 2], [3, 1, 4], [5, 5, 5]])
def test_commit_equals_decoding_the_accepted_tokens(accepted):
    t = make(3, seed=sum(accepted))
    slots = [4, 1, 7]
    conv, ssm = commit(t, slots, accepted)
    conv_want, ssm_want = decode_one_by_one(t, slots, accepted)
    torch.testing.assert_close(conv, conv_want, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ssm_want, rtol=1e-10, atol=1e-12)
    untouched = [s for s in range(9) if s not in slots]
    assert torch.equal(conv[:, untouched], t["conv_pool"][:, untouched])
    assert torch.equal(ssm[:, untouched], t["ssm_pool"][:, untouched])
    assert not torch.equal(ssm[:, slots], t["ssm_pool"][:, slots])


def test_commit_rejects_bad_lengths_and_shapes():
    t = make(2)
    with pytest.raises(ValueError, match="accepted lengths"):
        commit(t, [1, 2], [0, 2])
    with pytest.raises(ValueError, match="accepted lengths"):
        commit(t, [1, 2], [1, BLOCK + 1])
    with pytest.raises(ValueError, match="accepted must be"):
        commit(t, [1, 2], [1])
    bad = dict(t, a=t["a"][..., :3])
    with pytest.raises(ValueError, match="a and b"):
        commit(bad, [1, 2], [1, 1])
    bad = dict(t, conv_pool=t["conv_pool"][..., :2])
    with pytest.raises(ValueError, match="conv_pool"):
        commit(bad, [1, 2], [1, 1])
    bad = dict(t, A_log=t["A_log"][:2])
    with pytest.raises(ValueError, match="A_log"):
        commit(bad, [1, 2], [1, 1])
