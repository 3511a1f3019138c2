"""Our Triton kernels compile for the H200 (SM90) on any machine, GPU or not.

Triton's wheel carries LLVM and ptxas, so a kernel can be compiled for an explicit target
without a device. This catches what the interpreter cannot: type and layout errors of the
compiler, and the instruction order of the programmatic-dependent-launch (PDL) variants. The
compilation runs in a subprocess because the CPU test run sets ``TRITON_INTERPRET=1``, under
which ``@triton.jit`` builds interpreter functions that cannot be compiled.

Covered: the kernels that have not yet run on a GPU (the Triton MoE, the PDL launch variants,
the GDN walk with its sliding conv window) and the kernels they build on. Pointer and stride
arguments are compiled with the 16-divisibility hint Triton gives aligned tensors at launch, as
the real launches get it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# kernel -> (module, kernel attr, {arg: type} for runtime args, constexprs)
P, I32, F32 = "*bf16", "i32", "fp32"


def _specs() -> dict[str, tuple[str, str, dict, dict]]:
    gemv_args = dict(x=P, stride_xm=I32, w=P, stride_wn=I32, out=P, stride_om=I32, M=I32,
                     N=I32, K=I32)
    norm_args = dict(x=P, sx0=I32, sx1=I32, sx2=I32, sx3=I32, g=P, sg0=I32, sg1=I32, sg2=I32,
                     sg3=I32, w=P, stride_w=I32, out=P, summed=P, n_rows=I32, n1=I32, n2=I32,
                     n3=I32, H=I32, inv_h=F32, eps=F32)
    norm_consts = dict(ROUND_PROD=False, BR=1, BH=4096, CHUNKS=1)
    moe = "common.ops.moe.triton"
    specs = {}
    for pdl in (False, True):
        tag = "_pdl" if pdl else ""
        specs[f"gemv{tag}"] = ("common.ops.linear.triton", "_gemv_kernel", gemv_args,
                               dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, PDL=pdl))
        specs[f"gemv_ragged{tag}"] = ("common.ops.linear.triton", "_gemv_kernel", gemv_args,
                                      dict(BLOCK_M=2, BLOCK_N=4, BLOCK_K=512, EVEN_K=False,
                                           PDL=pdl))
        specs[f"dot{tag}"] = ("common.ops.linear.triton", "_dot_kernel", gemv_args,
                              dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, IEEE=False,
                                   PDL=pdl))
        specs[f"add_rms_norm{tag}"] = ("common.ops.norm.triton", "_norm_kernel", norm_args,
                                       dict(norm_consts, MODE=1, ADD=True, PDL=pdl))
        specs[f"gated_rms_norm{tag}"] = ("common.ops.norm.triton", "_norm_kernel", norm_args,
                                         dict(norm_consts, MODE=2, ADD=False, BH=128, BR=32,
                                              PDL=pdl))
        specs[f"silu_and_mul{tag}"] = ("common.ops.mlp.triton", "_silu_and_mul_kernel",
                                       dict(x=P, stride_x=I32, out=P, I=I32),
                                       dict(BLOCK=1024, PDL=pdl))
        specs[f"sigmoid_gate_mul{tag}"] = (
            "common.ops.attention.output_gate_triton", "_gate_kernel",
            dict(x=P, sxt=I32, sxh=I32, g=P, sgt=I32, sgh=I32, o=P, H=I32, D=I32),
            dict(BHEADS=1, BD=256, PDL=pdl))
    specs["moe_route"] = (moe, "_route_kernel",
                          dict(logits=P, stride_l=I32, ids="*i64", weights=P, E=I32),
                          dict(TOP_K=8, BLOCK_TOP=8, BLOCK_E=256, RENORM=True))
    specs["moe_gate_up"] = (moe, "_gate_up_kernel",
                            dict(x=P, stride_x=I32, ids="*i64", w=P, stride_we=I32,
                                 stride_wn=I32, act=P, I=I32, H=I32, P=I32, sg=P, su=P,
                                 stride_sn=I32, seg=P, sact=P, sgate=P, IS=I32),
                            dict(TOP_K=8, BLOCK_N=4, BLOCK_K=512, EVEN_K=True))
    specs["moe_down"] = (moe, "_down_kernel",
                         dict(act=P, ids="*i64", weights=P, w=P, stride_we=I32, stride_wn=I32,
                              out=P, H=I32, I=I32, sdown=P, stride_sdn=I32, sact=P, sgate=P,
                              IS=I32),
                         dict(TOP_K=8, BLOCK_N=4, BLOCK_K=512, EVEN_K=True, SHARED=True,
                              BLOCK_KS=512, EVEN_KS=True))
    # the GDN walk of a DFLASH verify (outputs) and commit (state), sliding conv window
    # (width 4) and tap by tap (other widths)
    replay_args = dict(qkv=P, q_l=I32, stride_r=I32, a=P, a_l=I32, stride_a=I32, b=P, b_l=I32,
                       stride_b=I32, lengths="*i32", cu="*i32", slots="*i64", conv=P, c_l=I32,
                       c_s=I32, c_d=I32, c_w=I32, w=P, w_l=I32, stride_wd=I32, A_log="*fp32",
                       al_l=I32, dt_bias="*fp32", dt_l=I32, ssm="*fp32", h_l=I32, h_s=I32,
                       h_h=I32, h_v=I32, h_k=I32, o=P, block=I32, scale=F32)
    for width in (4, 3):
        for mode, output, cu in (("verify", True, True), ("commit", False, False)):
            specs[f"gdn_{mode}_walk_w{width}"] = (
                "common.ops.gdn.replay_triton", "replay_kernel", replay_args,
                dict(HK=2, HV=4, K=128, V=128, BK=128, BV=8, W=width, THRESHOLD=20.0,
                     USE_CU=cu, OUTPUT=output, STORE=not output))
    # paged attention with lengths on the device: a verify's rows in key slices, a decode's
    # in one, and the merge of the slices
    attention = "common.ops.attention.paged_triton"
    paged_args = dict(q=P, kc=P, vc=P, table="*i32", row_start="*i32", work_req="*i32",
                      work_q0="*i32", q_start="*i32", q_count="*i32", kv_len="*i32", o=P,
                      part_o="*fp32", part_lse="*fp32", sq_t=I32, sq_h=I32, skc_p=I32,
                      skc_s=I32, skc_h=I32, svc_p=I32, svc_s=I32, svc_h=I32, page_step=I32,
                      so_t=I32, so_h=I32, H=I32, D=I32, qk_scale=F32)
    specs["paged_attention_verify_splits"] = (
        attention, "_paged_attention_kernel", paged_args,
        dict(PAGE=16, G=4, HPP=4, BQ=16, M=64, BD=128, BN=64, SPLITS=8, PREC="tf32"))
    specs["paged_attention_decode"] = (
        attention, "_paged_attention_kernel", paged_args,
        dict(PAGE=16, G=8, HPP=8, BQ=1, M=16, BD=256, BN=32, SPLITS=1, PREC="tf32"))
    specs["paged_attention_combine"] = (
        attention, "_combine_kernel",
        dict(part_o="*fp32", part_lse="*fp32", o=P, so_t=I32, so_h=I32, H=I32, D=I32),
        dict(SPLITS=8, BS=8, BD=128))
    return specs


def _compile_all() -> dict[str, dict]:
    """Run in the subprocess: compile every spec for SM90; name -> PTX facts, or the error."""
    import importlib
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, (module, attr, args, consts) in _specs().items():
        fn = getattr(importlib.import_module(module), attr)
        names = list(args)
        hints = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                 if args[a].startswith("*") or a.startswith("stride") or a.startswith("s")}
        signature = {**args, **{k: "constexpr" for k in consts}}
        try:
            src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=hints)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4, "launch_pdl": consts.get("PDL", False)})
        except Exception as exc:  # reported to the test, which names the kernel
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        # instructions without their predicate guard ("@%p3 ld.global...")
        ptx = [re.sub(r"^@!?%p\d+\s+", "", line.strip())
               for line in kernel.asm["ptx"].splitlines()]
        order = [("trigger" if s.startswith("griddepcontrol.launch_dependents") else
                  "wait" if s.startswith("griddepcontrol.wait") else
                  "weight" if s.startswith("ld.global.L1::evict_first") else
                  "load" if s.startswith("ld.global") else
                  "store" if s.startswith("st.global") else None) for s in ptx]
        results[name] = {"events": [e for e in order if e], "cubin": len(kernel.asm["cubin"])}
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    pytest.importorskip("triton", reason="triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(_specs()))
def test_kernel_compiles_for_sm90(compiled, name):
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["cubin"] > 0


@pytest.mark.parametrize("name", [n for n in sorted(_specs()) if n.endswith("_pdl")])
def test_pdl_kernels_wait_before_reading_activations_and_writing(compiled, name):
    events = compiled[name]["events"]
    assert events.count("wait") == 1 and events.count("trigger") == 1, events
    first_wait = events.index("wait")
    assert events.index("trigger") < first_wait
    # before the wait: at most weight loads (the GEMV's prefetch), never an activation load or a
    # store
    assert set(events[:first_wait]) <= {"trigger", "weight"}, events[:first_wait + 3]
    if name.startswith("gemv"):
        assert "weight" in events[:first_wait]  # the prefetch really is ahead of the wait


@pytest.mark.parametrize("name", [n for n in sorted(_specs())
                                  if not n.endswith("_pdl") and not n.startswith("moe")])
def test_plain_kernels_have_no_grid_dependency_control(compiled, name):
    assert "wait" not in compiled[name]["events"]
    assert "trigger" not in compiled[name]["events"]


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print(json.dumps(_compile_all()))
