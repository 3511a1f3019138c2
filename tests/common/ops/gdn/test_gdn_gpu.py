"""GPU Gated DeltaNet backends (fla, FlashInfer, our Triton recurrence) against the reference.

Inputs are random and never zero: packed sequences of odd lengths, HV = 2 HK, random initial
states, gates from ``gdn_gating`` of random projections. The reference runs in fp32 on the very
same (bf16-rounded) inputs. Tolerances:

- bf16 inputs: relative RMSE <= 1e-2 and cosine >= 0.9999 for outputs and final states;
- fp32 inputs, our Triton recurrence: max relative error <= 1e-4;
- fp32 inputs, fla chunked (tf32 matmuls): relative RMSE <= 5e-3.
"""

from __future__ import annotations

import pytest
import torch

from common.ops.gdn import reference as ref
from common.ops.gdn.reference import gdn_gating
from tests.common.compare import cosine, rel_rmse

pytestmark = pytest.mark.gpu

BF16_RMSE, BF16_COS = 1e-2, 0.9999


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_inputs(lens, hk, hv, dk, dv, dtype=torch.bfloat16, seed=0, state_scale=0.3):
    """Packed inputs as the model hands them over: q, k, v are strided views into one projection
    output, and the initial state is the transposed view of K-last ``[N, HV, V, K]`` pool rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, n = sum(lens), len(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    mixed = rand(t, 2 * hk * dk + hv * dv).to(dtype)
    q = mixed[:, : hk * dk].view(t, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(t, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(t, hv, dv)
    g, beta = gdn_gating(A_log=rand(hv) * 0.5, a=rand(t, hv), dt_bias=rand(hv), b=rand(t, hv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    pool = rand(n, hv, dv, dk) * state_scale
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, initial_state=pool.transpose(-1, -2))


def as_fp32(inp):
    return {key: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t) for key, t in inp.items()}


def check_bf16(record, name, got, want):
    rm, cs = rel_rmse(got, want), cosine(got, want)
    record(f"{name}.rel_rmse", rm)
    record(f"{name}.cosine", cs)
    record(f"{name}.max_abs", (got.double() - want.double()).abs().max().item())
    assert rm <= BF16_RMSE and cs >= BF16_COS, f"{name}: rel RMSE {rm:.3e}, cosine {cs:.6f}"


def _fla():
    pytest.importorskip("fla", reason="fla-core is not installed")
    from common.ops.gdn import fla

    return fla


def _flashinfer():
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from common.ops.gdn import flashinfer

    why = flashinfer.available()
    if why is not None:
        pytest.skip(f"FlashInfer GDN prefill unavailable: {why}")
    return flashinfer


LENS = [1, 37, 130, 1000]
GEOMETRIES = [(16, 32, 128, 128), (2, 4, 32, 32)]  # Qwen3.5 GDN heads; the built-in tiny model


@pytest.mark.parametrize("hk,hv,dk,dv", GEOMETRIES)
def test_fla_chunk_matches_reference(record_metric, hk, hv, dk, dv):
    fla = _fla()
    inp = make_inputs(LENS, hk, hv, dk, dv)
    s0 = inp["initial_state"].clone()
    o, s = fla.chunk_gated_delta_rule(**inp)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**as_fp32(inp))
    assert o.shape == o_ref.shape and o.dtype == torch.bfloat16
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    assert torch.equal(inp["initial_state"], s0), "initial_state was modified"
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)


def test_fla_chunk_fp32_and_contiguous_state(record_metric):
    fla = _fla()
    inp = as_fp32(make_inputs([3, 64, 65], 2, 4, 32, 32, seed=1))
    inp["initial_state"] = inp["initial_state"].contiguous()  # K-major storage: no state_v_first
    o, s = fla.chunk_gated_delta_rule(**inp)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**inp)
    record_metric("o.rel_rmse", rel_rmse(o, o_ref))
    record_metric("final_state.rel_rmse", rel_rmse(s, s_ref))
    assert o.dtype == torch.float32
    assert rel_rmse(o, o_ref) <= 5e-3 and rel_rmse(s, s_ref) <= 5e-3


@pytest.mark.parametrize("backend", ["fla", "triton"])
@pytest.mark.parametrize("hk,hv,dk,dv", GEOMETRIES)
def test_recurrent_decode_step_matches_reference(record_metric, backend, hk, hv, dk, dv):
    mod = _fla() if backend == "fla" else __import__("common.ops.gdn.triton", fromlist=["x"])
    inp = make_inputs([1] * 7, hk, hv, dk, dv, seed=2)
    s0 = inp["initial_state"].clone()
    o, s = mod.recurrent_gated_delta_rule(**inp)
    o_ref, s_ref = ref.recurrent_gated_delta_rule(**as_fp32(inp))
    assert torch.equal(inp["initial_state"], s0), "initial_state was modified"
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == s_ref.shape
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)


@pytest.mark.parametrize("backend", ["fla", "triton"])
def test_recurrent_verify_intermediate_states(record_metric, backend):
    """k tokens per request with the state after every token (speculative verify)."""
    mod = _fla() if backend == "fla" else __import__("common.ops.gdn.triton", fromlist=["x"])
    inp = make_inputs([4, 1, 7], 16, 32, 128, 128, seed=3)
    o, s, inter = mod.recurrent_gated_delta_rule(**inp, output_intermediate_states=True)
    o_ref, s_ref, inter_ref = ref.recurrent_gated_delta_rule(**as_fp32(inp), output_intermediate_states=True)
    assert inter.shape == inter_ref.shape and inter.dtype == torch.float32
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)
    check_bf16(record_metric, "intermediate_states", inter, inter_ref)
    # the last intermediate state of each request is its final state
    last = inp["cu_seqlens"][1:] - 1
    assert torch.allclose(inter[last.cuda()], s, rtol=0, atol=1e-6)


def test_triton_recurrent_fp32_is_tight(record_metric):
    from common.ops.gdn import triton as gdn_triton

    inp = as_fp32(make_inputs([5, 1, 3], 2, 4, 32, 32, seed=4))
    for state in (inp["initial_state"], inp["initial_state"].contiguous(), None):
        got = gdn_triton.recurrent_gated_delta_rule(**{**inp, "initial_state": state},
                                                   output_intermediate_states=True)
        want = ref.recurrent_gated_delta_rule(**{**inp, "initial_state": state},
                                              output_intermediate_states=True)
        for name, a, b in zip(("o", "final_state", "intermediate_states"), got, want):
            record_metric(f"{name}.max_rel", max_rel(a, b))
            assert max_rel(a, b) <= 1e-4, name


@pytest.mark.parametrize("backend", ["fla", "flashinfer"])
def test_prefill_state_hands_off_to_reference_decode(record_metric, backend):
    """The final state of a GPU prefill, stored K-last in a pool as the model does, continues in the
    reference recurrent step exactly as the reference's own prefill state does."""
    mod = _fla() if backend == "fla" else _flashinfer()
    hk, hv, dk, dv = 16, 32, 128, 128
    prompt = make_inputs([130, 37], hk, hv, dk, dv, seed=5)
    _, s_gpu = mod.chunk_gated_delta_rule(**prompt)
    _, s_ref = ref.chunk_gated_delta_rule(**as_fp32(prompt))
    pool = torch.empty(2, hv, dv, dk, device="cuda")
    pool[:] = s_gpu.transpose(-1, -2)  # into K-last pool rows, as GatedDeltaNet.forward stores it
    step = make_inputs([1, 1], hk, hv, dk, dv, seed=6)
    o_next, _ = ref.recurrent_gated_delta_rule(**as_fp32({**step, "initial_state": pool.transpose(-1, -2)}))
    o_want, _ = ref.recurrent_gated_delta_rule(**as_fp32({**step, "initial_state": s_ref}))
    check_bf16(record_metric, "next_output", o_next, o_want)


def test_flashinfer_chunk_matches_reference(record_metric):
    fi = _flashinfer()
    inp = make_inputs(LENS, 16, 32, 128, 128, seed=7)
    assert fi.dispatch(**inp) == "flashinfer+copy"  # v is a strided view of the projection output
    s0 = inp["initial_state"].clone()
    o, s = fi.chunk_gated_delta_rule(**inp)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**as_fp32(inp))
    assert torch.equal(inp["initial_state"], s0), "initial_state was modified"
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == s_ref.shape
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)


# the key / value head counts a rank holds: Qwen3.5-35B-A3B's at TP 2, 4 and 8, the larger
# trained target's, and the built-in model's
FEW_HEADS = [(8, 16), (4, 8), (2, 4), (1, 2)]


@pytest.mark.parametrize("lens", [[37], [37, 130]])
@pytest.mark.parametrize("hk,hv", FEW_HEADS)
def test_flashinfer_chunk_with_few_heads(record_metric, hk, hv, lens):
    """One sequence takes FlashInfer's context-parallel kernel, several its batched one; a
    tensor-parallel rank's or a small model's head counts go through both."""
    fi = _flashinfer()
    inp = make_inputs(lens, hk, hv, 128, 128, seed=10 + hk)
    o, s = fi.chunk_gated_delta_rule(**inp)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**as_fp32(inp))
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)


def test_flashinfer_chunk_single_long_sequence(record_metric):
    fi = _flashinfer()
    inp = make_inputs([3000], 16, 32, 128, 128, seed=8)
    o, s = fi.chunk_gated_delta_rule(**inp)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**as_fp32(inp))
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)


def test_flashinfer_misaligned_inputs_are_copied(record_metric):
    """A contiguous view at an odd storage offset is misaligned: it must be copied, not rejected."""
    fi = _flashinfer()
    inp = make_inputs([37, 130], 16, 32, 128, 128, seed=9)
    v = inp["v"].contiguous()
    buf = torch.empty(v.numel() + 1, dtype=v.dtype, device="cuda")
    shifted = buf[1:].view(v.shape)  # base pointer 2 bytes past an aligned block
    shifted.copy_(v)
    assert shifted.data_ptr() % 16 != 0
    bbuf = torch.empty(inp["beta"].numel() + 1, dtype=torch.float32, device="cuda")
    beta = bbuf[1:].view(inp["beta"].shape)
    beta.copy_(inp["beta"])
    aligned_inp = {**inp, "v": v}
    misaligned = {**inp, "v": shifted, "beta": beta}
    assert fi.dispatch(**aligned_inp) == "flashinfer"
    assert fi.dispatch(**misaligned) == "flashinfer+copy"
    o_a, s_a = fi.chunk_gated_delta_rule(**aligned_inp)
    o_m, s_m = fi.chunk_gated_delta_rule(**misaligned)
    record_metric("o.max_abs_vs_aligned", (o_a.float() - o_m.float()).abs().max().item())
    assert torch.allclose(o_a.float(), o_m.float(), rtol=0, atol=1e-2)
    assert torch.allclose(s_a, s_m, rtol=1e-3, atol=1e-3)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**as_fp32(inp))
    check_bf16(record_metric, "o", o_m, o_ref)


def test_flashinfer_unsupported_goes_to_fla(record_metric):
    """Head dim 32 and fp32 inputs are not FlashInfer's: the op falls back to fla, same contract."""
    from common.ops.gdn import flashinfer as fi

    _fla()
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    inp = make_inputs(LENS, 2, 4, 32, 32, seed=10)
    assert fi.dispatch(**inp) == "fla"
    assert fi.dispatch(**as_fp32(make_inputs([5], 16, 32, 128, 128))) == "fla"
    o, s = fi.chunk_gated_delta_rule(**inp)
    o_ref, s_ref = ref.chunk_gated_delta_rule(**as_fp32(inp))
    check_bf16(record_metric, "o", o, o_ref)
    check_bf16(record_metric, "final_state", s, s_ref)


def test_cuda_cu_seqlens_accepted():
    """cu_seqlens may already live on the GPU (no host read is needed by the kernels)."""
    fla = _fla()
    from common.ops.gdn import triton as gdn_triton

    inp = make_inputs([5, 9], 2, 4, 32, 32, seed=11)
    on_gpu = {**inp, "cu_seqlens": inp["cu_seqlens"].cuda()}
    for fn in (fla.chunk_gated_delta_rule, fla.recurrent_gated_delta_rule,
               gdn_triton.recurrent_gated_delta_rule):
        a = fn(**inp)
        b = fn(**on_gpu)
        for x, y in zip(a, b):
            assert torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-5)


# --- the in-place decode step on the state pool ---

POOL_SLOTS = 50
IN_PLACE_GEOMETRIES = [(16, 32, 128, 128), (8, 8, 128, 128), (8, 8, 128, 72)]


def make_decode_in_place(n, hk, hv, dk, dv, dtype, seed, padding=0):
    """One decode token for each of n requests on shuffled slots of a 50-slot fp32 pool, plus
    ``padding`` rows that all name scratch slot 0 (as a padded CUDA-graph batch does)."""
    inp = make_inputs([1] * (n + padding), hk, hv, dk, dv, dtype=dtype, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000)
    pool = torch.randn(POOL_SLOTS, hv, dv, dk, generator=gen, device="cuda") * 0.3
    live = torch.randperm(POOL_SLOTS - 1, generator=gen, device="cuda")[:n] + 1
    slots = torch.cat([live, torch.zeros(padding, dtype=torch.int64, device="cuda")])
    t = n + padding
    # raw gate projections, as the model hands them to the decode op
    gates = dict(a=torch.randn(t, hv, generator=gen, device="cuda").to(dtype),
                 b=torch.randn(t, hv, generator=gen, device="cuda").to(dtype),
                 A_log=torch.randn(hv, generator=gen, device="cuda") * 0.5,
                 dt_bias=torch.randn(hv, generator=gen, device="cuda").to(dtype))
    step = {key: inp[key] for key in ("q", "k", "v")} | gates
    return step, pool, slots


def _triton_gdn():
    pytest.importorskip("triton", reason="triton is not installed")
    from common.ops.gdn import triton as gdn_triton

    return gdn_triton


def check_in_place(record, dtype, o, pool, o_ref, pool_ref, before, slots, n):
    """o and the n live slots against the reference; every other slot but scratch 0 unchanged."""
    live = slots[:n]
    assert o.dtype == dtype and o.shape == o_ref.shape
    if dtype == torch.float32:
        for name, a, b in (("o", o[:n], o_ref[:n]), ("state", pool[live], pool_ref[live])):
            record(f"{name}.max_rel", max_rel(a, b))
            assert max_rel(a, b) <= 1e-4, name
    else:
        check_bf16(record, "o", o[:n], o_ref[:n])
        check_bf16(record, "state", pool[live], pool_ref[live])
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[slots] = False
    assert torch.equal(pool[others], before[others]), "a slot outside `slots` was written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hk,hv,dk,dv", IN_PLACE_GEOMETRIES)
@pytest.mark.parametrize("n", [1, 3, 37])
def test_triton_decode_in_place_matches_reference(record_metric, dtype, hk, hv, dk, dv, n):
    tr = _triton_gdn()
    step, pool, slots = make_decode_in_place(n, hk, hv, dk, dv, dtype, seed=20 + n)
    before, pool_ref = pool.clone(), pool.clone()
    o = tr.gdn_decode_in_place(**step, ssm_pool=pool, slots=slots)
    o_ref = ref.gdn_decode_in_place(**as_fp32(step), ssm_pool=pool_ref, slots=slots)
    check_in_place(record_metric, dtype, o, pool, o_ref, pool_ref, before, slots, n)


def test_triton_decode_in_place_padding_rows_share_scratch_slot(record_metric):
    """Padding rows all on slot 0 race there (slot 0 is garbage) but must not disturb live rows."""
    tr = _triton_gdn()
    step, pool, slots = make_decode_in_place(5, 16, 32, 128, 128, torch.bfloat16, seed=30, padding=11)
    before, pool_ref = pool.clone(), pool.clone()
    o = tr.gdn_decode_in_place(**step, ssm_pool=pool, slots=slots)
    o_ref = ref.gdn_decode_in_place(**as_fp32(step), ssm_pool=pool_ref, slots=slots)
    check_in_place(record_metric, torch.bfloat16, o, pool, o_ref, pool_ref, before, slots, 5)


def test_triton_decode_in_place_replays_in_cuda_graph(record_metric):
    """Captured once; slots, inputs and pool changed in place between replays, as a decode graph
    sees them. The last rows are padding on scratch slot 0."""
    tr = _triton_gdn()
    n, padding, hk, hv, dk, dv = 6, 2, 16, 32, 128, 128
    step, pool, slots = make_decode_in_place(n, hk, hv, dk, dv, torch.bfloat16, seed=40, padding=padding)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        tr.gdn_decode_in_place(**step, ssm_pool=pool, slots=slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = tr.gdn_decode_in_place(**step, ssm_pool=pool, slots=slots)
    for replay in range(3):
        new_step, new_pool, new_slots = make_decode_in_place(n, hk, hv, dk, dv, torch.bfloat16,
                                                             seed=41 + replay, padding=padding)
        for key in step:
            step[key].copy_(new_step[key])
        pool.copy_(new_pool)
        slots.copy_(new_slots)
        before, pool_ref = pool.clone(), pool.clone()
        graph.replay()
        o_ref = ref.gdn_decode_in_place(**as_fp32(step), ssm_pool=pool_ref, slots=slots)
        check_in_place(record_metric, torch.bfloat16, o, pool, o_ref, pool_ref, before, slots, n)
