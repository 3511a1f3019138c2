import pytest
import torch
import torch.nn.functional as F

from common.ops.gdn.reference import (
    chunk_gated_delta_rule,
    gdn_decode_in_place,
    gdn_gating,
    recurrent_gated_delta_rule,
)

K_DIM, V_DIM = 12, 10


def _inputs(lens, hk, hv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    g, beta = gdn_gating(A_log=rand(hv) * 0.5, a=rand(t, hv), dt_bias=rand(hv), b=rand(t, hv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    return dict(
        q=rand(t, hk, K_DIM),
        k=rand(t, hk, K_DIM),
        v=rand(t, hv, V_DIM),
        g=g.to(dtype),
        beta=beta.to(dtype),
        cu_seqlens=cu,
        initial_state=rand(n, hv, K_DIM, V_DIM) * 0.3,
    )


def _max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
def test_chunked_equals_recurrent_fp64(hk, hv):
    inp = _inputs([1, 37, 130], hk, hv)
    s0 = inp["initial_state"].clone()
    o_c, s_c = chunk_gated_delta_rule(**inp)
    o_r, s_r = recurrent_gated_delta_rule(**inp)
    assert o_c.shape == (168, hv, V_DIM) and s_c.shape == (3, hv, K_DIM, V_DIM)
    assert o_c.dtype == s_c.dtype == torch.float64
    assert (o_c - o_r).abs().max().item() <= 1e-10
    assert (s_c - s_r).abs().max().item() <= 1e-10
    assert torch.equal(inp["initial_state"], s0)  # never written in place


def test_chunk_sizes_agree():
    inp = _inputs([5, 70, 33], 2, 4, seed=1)
    o64, s64 = chunk_gated_delta_rule(**inp, chunk_size=64)
    o16, s16 = chunk_gated_delta_rule(**inp, chunk_size=16)
    torch.testing.assert_close(o16, o64, rtol=0, atol=1e-11)
    torch.testing.assert_close(s16, s64, rtol=0, atol=1e-11)


def test_prefill_then_recurrent_equals_one_pass():
    lens, split = [23, 81], [9, 70]
    inp = _inputs(lens, 2, 4, seed=2)
    o_full, s_full = chunk_gated_delta_rule(**inp, chunk_size=16)
    starts = inp["cu_seqlens"][:-1].tolist()
    first = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, split)])
    rest = torch.cat([torch.arange(s + n, s + l) for s, n, l in zip(starts, split, lens)])

    def part(idx, counts, state):
        cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        fields = {k: inp[k][idx] for k in ("q", "k", "v", "g", "beta")}
        return dict(fields, cu_seqlens=cu, initial_state=state)

    o1, s1 = chunk_gated_delta_rule(**part(first, split, inp["initial_state"]), chunk_size=16)
    o2, s2 = recurrent_gated_delta_rule(**part(rest, [l - n for n, l in zip(split, lens)], s1))
    torch.testing.assert_close(o1, o_full[first], rtol=0, atol=1e-11)
    torch.testing.assert_close(o2, o_full[rest], rtol=0, atol=1e-11)
    torch.testing.assert_close(s2, s_full, rtol=0, atol=1e-11)


def test_intermediate_states():
    inp = _inputs([4, 1, 9], 1, 2, seed=3)
    o, s, inter = recurrent_gated_delta_rule(**inp, output_intermediate_states=True)
    assert inter.shape == (14, 2, K_DIM, V_DIM)
    ends = inp["cu_seqlens"][1:] - 1
    torch.testing.assert_close(inter[ends], s, rtol=0, atol=0)
    # Stopping after any token of a sequence reproduces that token's intermediate state.
    cut = {k: inp[k][:6] for k in ("q", "k", "v", "g", "beta")}
    _, s_cut = recurrent_gated_delta_rule(
        **cut, cu_seqlens=torch.tensor([0, 4, 5, 6]), initial_state=inp["initial_state"]
    )
    torch.testing.assert_close(s_cut[2], inter[5], rtol=0, atol=1e-13)


def test_decode_batch_matches_single_sequences():
    inp = _inputs([1, 1, 1, 1], 2, 4, seed=4)
    o, s = recurrent_gated_delta_rule(**inp)
    for r in range(4):
        one = {k: inp[k][r : r + 1] for k in ("q", "k", "v", "g", "beta")}
        o_r, s_r = recurrent_gated_delta_rule(
            **one, cu_seqlens=torch.tensor([0, 1]), initial_state=inp["initial_state"][r : r + 1]
        )
        torch.testing.assert_close(o[r : r + 1], o_r, rtol=0, atol=0)
        torch.testing.assert_close(s[r : r + 1], s_r, rtol=0, atol=0)


def test_bf16_inputs_keep_output_dtype_and_fp32_state():
    inp = _inputs([7, 20], 2, 4, dtype=torch.bfloat16, seed=5)
    inp["initial_state"] = inp["initial_state"].float()
    o, s = chunk_gated_delta_rule(**inp)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_r, s_r, inter = recurrent_gated_delta_rule(**inp, output_intermediate_states=True)
    assert o_r.dtype == torch.bfloat16 and s_r.dtype == inter.dtype == torch.float32
    assert _max_rel(s, s_r) < 1e-4


def test_no_initial_state_and_custom_scale():
    inp = _inputs([13], 2, 2, seed=6)
    inp["initial_state"] = None
    o_c, s_c = chunk_gated_delta_rule(**inp, scale=0.7, use_qk_l2norm=False, chunk_size=4)
    o_r, s_r = recurrent_gated_delta_rule(**inp, scale=0.7, use_qk_l2norm=False)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=1e-10)


def test_empty_sequence_passes_its_state_through():
    inp = _inputs([0, 6, 0], 2, 4, seed=10)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(**inp)
        assert o.shape == (6, 4, V_DIM)
        torch.testing.assert_close(s[0], inp["initial_state"][0], rtol=0, atol=0)
        torch.testing.assert_close(s[2], inp["initial_state"][2], rtol=0, atol=0)


@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
def test_matches_transformers(hk, hv):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    lens = [37, 130]
    inp = _inputs(lens, hk, hv, dtype=torch.float32, seed=7)
    o, s = chunk_gated_delta_rule(**inp)
    o_rec, s_rec = recurrent_gated_delta_rule(**inp)
    r = hv // hk
    for seq, (start, end) in enumerate(zip(inp["cu_seqlens"][:-1].tolist(), inp["cu_seqlens"][1:].tolist())):
        args = dict(
            query=inp["q"][start:end].repeat_interleave(r, dim=1)[None],
            key=inp["k"][start:end].repeat_interleave(r, dim=1)[None],
            value=inp["v"][start:end][None],
            g=inp["g"][start:end][None],
            beta=inp["beta"][start:end][None],
            initial_state=inp["initial_state"][seq : seq + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
            o_hf, s_hf = fn(**args)
            for mine_o, mine_s in ((o, s), (o_rec, s_rec)):
                assert _max_rel(mine_o[start:end], o_hf[0]) < 1e-5
                assert _max_rel(mine_s[seq], s_hf[0]) < 1e-5


def test_gating_formula_and_dtypes():
    gen = torch.Generator().manual_seed(8)
    hv = 5
    A_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    a, b = torch.randn(9, hv, generator=gen) * 15, torch.randn(9, hv, generator=gen)
    g, beta = gdn_gating(A_log=A_log, a=a.bfloat16(), dt_bias=dt_bias, b=b.bfloat16())
    assert g.dtype == beta.dtype == torch.float32 and g.shape == (9, hv)
    expected = -A_log.exp() * F.softplus(a.bfloat16().float() + dt_bias)
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    torch.testing.assert_close(beta, torch.sigmoid(b.bfloat16().float()), rtol=0, atol=0)
    assert (g <= 0).all()
    g64, beta64 = gdn_gating(A_log=A_log.double(), a=a.double(), dt_bias=dt_bias.double(), b=b.double())
    assert g64.dtype == beta64.dtype == torch.float64


def test_caller_mistakes_raise_value_error():
    inp = _inputs([3, 4], 2, 4, seed=9)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(**dict(inp, cu_seqlens=torch.tensor([0, 3, 6])))
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_gated_delta_rule(**dict(inp, initial_state=inp["initial_state"].transpose(-1, -2)))
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(**dict(inp, v=torch.randn(7, 3, V_DIM, dtype=torch.float64)))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(**inp, chunk_size=0)
    with pytest.raises(ValueError, match="A_log"):
        gdn_gating(A_log=torch.randn(3), a=torch.randn(2, 4), dt_bias=torch.randn(4), b=torch.randn(2, 4))


def _decode_in_place_inputs(n, hk, hv, num_slots, dtype=torch.float64, seed=0):
    """One token per request with raw gate projections (the decode op's inputs)."""
    inp = _inputs([1] * n, hk, hv, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    pool = torch.randn(num_slots, hv, V_DIM, K_DIM, generator=gen, dtype=torch.float64).to(
        torch.float32 if dtype != torch.float64 else dtype)
    slots = torch.randperm(num_slots - 1, generator=gen)[:n] + 1  # shuffled, never scratch slot 0
    gates = dict(a=torch.randn(n, hv, generator=gen, dtype=torch.float64).to(dtype),
                 b=torch.randn(n, hv, generator=gen, dtype=torch.float64).to(dtype),
                 A_log=torch.randn(hv, generator=gen, dtype=torch.float64) * 0.5,
                 dt_bias=torch.randn(hv, generator=gen, dtype=torch.float64).to(dtype))
    step = {key: inp[key] for key in ("q", "k", "v")} | gates
    return step, pool, slots


def _formed_gates(step):
    """q, k, v with g and beta formed from the raw projections: the recurrence's inputs."""
    g, beta = gdn_gating(A_log=step["A_log"], a=step["a"], dt_bias=step["dt_bias"], b=step["b"])
    return dict(q=step["q"], k=step["k"], v=step["v"], g=g, beta=beta)


@pytest.mark.parametrize("n,hk,hv", [(1, 2, 4), (3, 3, 3), (9, 2, 4)])
def test_decode_in_place_equals_recurrent_on_gathered_rows(n, hk, hv):
    step, pool, slots = _decode_in_place_inputs(n, hk, hv, num_slots=13, seed=n)
    before = pool.clone()
    o = gdn_decode_in_place(**step, ssm_pool=pool, slots=slots)
    o_want, s_want = recurrent_gated_delta_rule(
        **_formed_gates(step), cu_seqlens=torch.arange(n + 1),
        initial_state=before[slots].transpose(-1, -2))
    torch.testing.assert_close(o, o_want, rtol=0, atol=0)
    torch.testing.assert_close(pool[slots], s_want.transpose(-1, -2), rtol=0, atol=0)
    untouched = torch.ones(13, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_in_place_dtypes_and_padding_rows_on_scratch_slot():
    """bf16 inputs give a bf16 output and an fp32 pool; padding rows all on slot 0 leave live rows right."""
    step, pool, _ = _decode_in_place_inputs(5, 2, 4, num_slots=8, dtype=torch.bfloat16, seed=11)
    slots = torch.tensor([4, 0, 2, 0, 0])
    before = pool.clone()
    o = gdn_decode_in_place(**step, ssm_pool=pool, slots=slots, scale=0.5)
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    live = torch.tensor([0, 2])
    one = {key: t[live] for key, t in _formed_gates(step).items()}
    o_want, s_want = recurrent_gated_delta_rule(**one, cu_seqlens=torch.arange(3), scale=0.5,
                                                initial_state=before[slots[live]].transpose(-1, -2))
    # another batch size may reduce in another order: equal to within rounding
    torch.testing.assert_close(o[live], o_want)
    torch.testing.assert_close(pool[slots[live]], s_want.transpose(-1, -2), rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[[1, 3, 5, 6, 7]], before[[1, 3, 5, 6, 7]])


def test_decode_in_place_caller_mistakes_raise_value_error():
    step, pool, slots = _decode_in_place_inputs(3, 2, 4, num_slots=6, seed=12)
    with pytest.raises(ValueError, match="ssm_pool"):
        gdn_decode_in_place(**step, ssm_pool=pool.transpose(-1, -2), slots=slots)
    with pytest.raises(ValueError, match="slots"):
        gdn_decode_in_place(**step, ssm_pool=pool, slots=slots[:2])
    with pytest.raises(ValueError, match="slots"):
        gdn_decode_in_place(**step, ssm_pool=pool, slots=slots.double())
    with pytest.raises(ValueError, match="a and b"):
        gdn_decode_in_place(**dict(step, b=step["b"][:, :1]), ssm_pool=pool, slots=slots)
    with pytest.raises(ValueError, match="A_log"):
        gdn_decode_in_place(**dict(step, A_log=step["A_log"][:1]), ssm_pool=pool, slots=slots)
