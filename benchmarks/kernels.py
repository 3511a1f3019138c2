"""Per-op kernel timings on the GPU: every registered backend against the plain-torch reference.

Shapes are one layer of Qwen3.5-4B and Qwen3.5-35B-A3B (``benchmarks/shapes.py``); inputs are
laid out as the model passes them (q/k/v as views into the projection output, GDN states as
transposed views of K-last pool rows, K/V as views of the paged pool). Each case is run for
warm-up, then timed with CUDA events around each call; the median over the runs is reported.
The first call of a backend JIT-compiles (FlashInfer, fla, Triton): warm-up absorbs it.

    python -m benchmarks.kernels --out out/kernels.json
    python -m benchmarks.kernels --ops gdn_prefill,paged_attention --quick

Prints a table last; writes every row as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.shapes import shape_config
from common.cache.kv_pool import page_table
from common.ops.registry import default_registry

MODELS = ("qwen3.5-4b", "qwen3.5-35b-a3b")
OPS = ("gdn_prefill", "gdn_decode", "gdn_verify", "gdn_decode_in_place", "conv1d_prefill",
       "conv1d_update", "paged_attention")
PAGE = 16


def time_call(fn, *, warmup: int, budget_ms: float, min_runs: int = 3, max_runs: int = 30) -> dict:
    """Median / min milliseconds of ``fn()`` over runs timed with CUDA events (one pair per run)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    runs = max(min_runs, min(max_runs, int(budget_ms / max(est, 1e-3))))
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "min_ms": min(times), "runs": runs}


def gdn_inputs(lens, hk, hv, dk, dv, *, dtype=torch.bfloat16, seed=0):
    from common.ops.gdn.reference import gdn_gating

    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, n = sum(lens), len(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    mixed = rand(t, 2 * hk * dk + hv * dv).to(dtype)
    g, beta = gdn_gating(A_log=rand(hv) * 0.5, a=rand(t, hv), dt_bias=rand(hv), b=rand(t, hv))
    return dict(q=mixed[:, : hk * dk].view(t, hk, dk), k=mixed[:, hk * dk : 2 * hk * dk].view(t, hk, dk),
                v=mixed[:, 2 * hk * dk :].view(t, hv, dv), g=g, beta=beta,
                cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64),
                initial_state=(rand(n, hv, dv, dk) * 0.3).transpose(-1, -2))


def cases_gdn_prefill(cfg, quick):
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    for t in ((512, 8192) if quick else (512, 2048, 8192, 32768)):
        for n in (1, 4):
            lens = [t // n] * n
            flops = 4 * t * hv * dk * dv  # the two state GEMMs per token and value head

            def make(lens=lens):
                return gdn_inputs(lens, hk, hv, dk, dv)
            yield f"T={t} N={n}", make, {"tflops": flops}, False


def cases_gdn_decode(cfg, quick):
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    for b in ((1, 64) if quick else (1, 8, 64)):
        state_bytes = 2 * b * hv * dk * dv * 4  # fp32 state read and written once per step

        def make(b=b):
            return gdn_inputs([1] * b, hk, hv, dk, dv)
        yield f"B={b}", make, {"gbps": state_bytes}, False


def cases_gdn_verify(cfg, quick):
    """N requests verifying a block of B tokens each (the token recurrence, no state written)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    for b in (8, 16):
        for n in ((1, 8) if quick else (1, 8, 64)):
            def make(b=b, n=n):
                return gdn_inputs([b] * n, hk, hv, dk, dv, seed=b + n)
            yield f"B={b} N={n}", make, {"gbps": 2 * n * hv * dk * dv * 4}, False


def cases_gdn_decode_in_place(cfg, quick):
    """One token per request, states read and written in a pool of 4·B slots by slot index."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    for b in ((1, 64) if quick else (1, 8, 64)):
        def make(b=b):
            inputs = gdn_inputs([1] * b, hk, hv, dk, dv, seed=b)
            gen = torch.Generator(device="cuda").manual_seed(b)
            pool = torch.randn(4 * b + 1, hv, dv, dk, generator=gen, device="cuda") * 0.3
            slots = torch.randperm(4 * b, generator=torch.Generator().manual_seed(b))[:b] + 1
            for key in ("cu_seqlens", "initial_state", "g", "beta"):
                inputs.pop(key)
            # the decode op takes the raw gate projections
            gates = dict(a=torch.randn(b, hv, generator=gen, device="cuda").to(torch.bfloat16),
                         b=torch.randn(b, hv, generator=gen, device="cuda").to(torch.bfloat16),
                         A_log=torch.randn(hv, generator=gen, device="cuda") * 0.5,
                         dt_bias=torch.randn(hv, generator=gen, device="cuda").to(torch.bfloat16))
            return dict(inputs, **gates, ssm_pool=pool, slots=slots.to("cuda"))
        yield f"B={b}", make, {"gbps": 2 * b * hv * dk * dv * 4}, False


def cases_conv1d_prefill(cfg, quick):
    d, w = cfg.conv_dim, cfg.linear_conv_kernel_dim
    for t in ((512, 8192) if quick else (512, 2048, 8192, 32768)):
        for n in (1, 4):
            def make(t=t, n=n):
                gen = torch.Generator(device="cuda").manual_seed(t + n)
                x = torch.randn(t, d, generator=gen, device="cuda").to(torch.bfloat16)  # in_proj_qkv output
                return dict(x=x, weight=torch.randn(d, w, generator=gen, device="cuda").to(torch.bfloat16),
                            cu_seqlens=torch.tensor([i * (t // n) for i in range(n + 1)]),
                            initial_state=torch.randn(n, d, w - 1, generator=gen, device="cuda").to(torch.bfloat16))
            yield f"T={t} N={n}", make, {"gbps": 2 * t * d * 2}, False


def cases_conv1d_update(cfg, quick):
    d, w = cfg.conv_dim, cfg.linear_conv_kernel_dim
    for b in ((1, 64) if quick else (1, 8, 64)):
        def make(b=b):
            gen = torch.Generator(device="cuda").manual_seed(b)
            return dict(x=torch.randn(b, d, generator=gen, device="cuda").to(torch.bfloat16),
                        conv_state=torch.randn(b, d, w - 1, generator=gen, device="cuda").to(torch.bfloat16),
                        weight=torch.randn(d, w, generator=gen, device="cuda").to(torch.bfloat16))
        yield f"B={b}", make, {}, False


def attention_inputs(prefix, extend, heads, kv_heads, head_dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-(p + e) // PAGE) for p, e in zip(prefix, extend)]
    num_pages = sum(need) + 1
    kv = torch.randn(num_pages, 2, PAGE, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    order = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    rows, at = [], 0
    for c in need:
        rows.append(order[at : at + c])
        at += c
    table = page_table(rows, "cuda")
    q = torch.randn(sum(extend), heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    return dict(q=q, k_cache=kv[:, 0], v_cache=kv[:, 1], page_table=table, prefix_lens=list(prefix),
                extend_lens=list(extend), scale=head_dim ** -0.5)


def cases_paged_attention(cfg, quick):
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    prefill = [("prefill 1x2048", [0], [2048]),
               ("prefill 4x512 over 1536", [1536] * 4, [512] * 4),
               ("prefill 1x8192", [0], [8192])]
    decode = [(f"decode B={b} ctx=4096", [4095] * b, [1] * b) for b in ((1, 64) if quick else (1, 8, 64))]
    for name, prefix, extend in (prefill[:2] if quick else prefill) + decode:
        # attended (query, key) pairs, causal inside the new tokens
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix, extend))
        kv_bytes = sum(p + e for p, e in zip(prefix, extend)) * kvh * hd * 2 * 2
        # the reference materialises [H, new, total] fp32 scores per request: skip it when huge
        skip_ref = max(h * e * (p + e) for p, e in zip(prefix, extend)) >= 2 ** 30

        def make(prefix=prefix, extend=extend):
            return attention_inputs(prefix, extend, h, kvh, hd)
        extra = {"tflops": 4 * pairs * h * hd} if extend[0] > 1 else {"gbps": kv_bytes}
        yield name, make, extra, skip_ref


CASES = {
    "gdn_prefill": ("chunk_gated_delta_rule", cases_gdn_prefill),
    "gdn_decode": ("recurrent_gated_delta_rule", cases_gdn_decode),
    "gdn_verify": ("recurrent_gated_delta_rule", cases_gdn_verify),
    "gdn_decode_in_place": ("gdn_decode_in_place", cases_gdn_decode_in_place),
    "conv1d_prefill": ("causal_conv1d_prefill", cases_conv1d_prefill),
    "conv1d_update": ("causal_conv1d_update", cases_conv1d_update),
    "paged_attention": ("paged_attention", cases_paged_attention),
}
# GDN and conv shapes are identical in both models (16 k-heads, 32 v-heads, d=128, conv_dim 8192)
MODEL_INDEPENDENT = {"gdn_prefill", "gdn_decode", "gdn_verify", "gdn_decode_in_place",
                     "conv1d_prefill", "conv1d_update"}


def _path(op: str, backend: str, inputs: dict) -> str:
    """The code path a backend takes for these inputs (backends fall back for inputs they lack)."""
    if op == "chunk_gated_delta_rule" and backend == "flashinfer":
        from common.ops.gdn.flashinfer import dispatch

        return dispatch(**inputs)
    if op == "paged_attention" and backend == "flashinfer":
        from common.ops.attention.flashinfer import supports

        if not supports(inputs["q"], inputs["k_cache"]):
            return "reference"
        return "decode" if max(inputs["extend_lens"]) == 1 else "prefill"
    return backend


def run(ops, models, quick, budget_ms, log, rows: list[dict]) -> list[dict]:
    """Appends one row per (case, backend) to ``rows`` as it goes (kept if interrupted)."""
    registry = default_registry()
    for op_key in ops:
        op, gen_cases = CASES[op_key]
        backends = registry.backends(op)
        op_models = models[:1] if op_key in MODEL_INDEPENDENT else models
        for model in op_models:
            cfg = shape_config(model)
            shape_name = "qwen3.5 (4b, 35b-a3b)" if op_key in MODEL_INDEPENDENT else model
            for case, make, extra, skip_ref in gen_cases(cfg, quick):
                inputs = make()
                ref_ms = None
                for backend in ["reference"] + [b for b in backends if b != "reference"]:
                    row = {"op": op_key, "registry_op": op, "shape": shape_name, "case": case,
                           "backend": backend}
                    if backend == "reference" and skip_ref:
                        row["skipped"] = "reference too large for this shape"
                        rows.append(row)
                        continue
                    fn = registry.get(op, backend)
                    row["path"] = _path(op, backend, inputs)
                    try:
                        with torch.inference_mode():
                            res = time_call(lambda: fn(**inputs), warmup=1 if backend == "reference" else 3,
                                            budget_ms=budget_ms if backend != "reference" else budget_ms / 4,
                                            max_runs=30 if backend != "reference" else 5)
                    except Exception as exc:  # keep measuring the others; the row says why
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc(file=log)
                        rows.append(row)
                        continue
                    row.update(res)
                    if "tflops" in extra:
                        row["tflops"] = extra["tflops"] / (res["ms"] * 1e-3) / 1e12
                    if "gbps" in extra:
                        row["gbps"] = extra["gbps"] / (res["ms"] * 1e-3) / 1e9
                    if backend == "reference":
                        ref_ms = res["ms"]
                    elif ref_ms is not None:
                        row["speedup"] = ref_ms / res["ms"]
                    rows.append(row)
                    print(json.dumps(row), file=log, flush=True)
                inputs = None  # free before the next case
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'op':<16} {'shape':<22} {'case':<26} {'backend':<11} {'ms':>9} {'x ref':>8} {'TFLOP/s':>8} "
            f"{'GB/s':>7}  path")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "ms" not in r:
            note = r.get("skipped") or r.get("error", "")
            lines.append(f"{r['op']:<16} {r['shape']:<22} {r['case']:<26} {r['backend']:<11} {'-':>9}  {note[:60]}")
            continue
        sp = f"{r['speedup']:.1f}" if "speedup" in r else ""
        tf = f"{r['tflops']:.1f}" if "tflops" in r else ""
        gb = f"{r['gbps']:.0f}" if "gbps" in r else ""
        lines.append(f"{r['op']:<16} {r['shape']:<22} {r['case']:<26} {r['backend']:<11} {r['ms']:>9.3f} "
                     f"{sp:>8} {tf:>8} {gb:>7}  {r.get('path', '')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/kernels.json", help="JSON file for all rows")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated benchmarks/shapes.py names")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--budget-ms", type=float, default=300.0, help="time spent timing each backend per case")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels needs a CUDA device", file=sys.stderr)
        return 2
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {OPS}")
    models = [m for m in args.models.split(",") if m]
    started = time.time()
    rows: list[dict] = []
    interrupted = False
    try:
        run(ops, models, args.quick, args.budget_ms, sys.stderr, rows)
    except KeyboardInterrupt:  # e.g. `timeout -s INT`: report what was measured
        interrupted = True
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - started, 1),
            "argv": sys.argv[1:], "interrupted": interrupted}
    for mod in ("triton", "fla", "flashinfer"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            meta[mod] = None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))
    print(table(rows))
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
