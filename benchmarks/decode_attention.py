"""Graph-mode decode and verify attention: FlashInfer's two decode kernels and our Triton kernel.

Decode and verify steps replay one graph attention plan per full-attention layer. This times,
in the same run, on Qwen3.5 layer shapes (heads, KV heads, head dim from
``benchmarks/shapes.py``) for a few batch sizes, context lengths and new tokens per row (1:
decode; 16: a DFLASH verify block): FlashInfer's CUDA-core and tensor-core decode kernels
(``FlashInferGraphAttention``; the CUDA-core one runs one token per row only) and our Triton
kernel (``TritonGraphAttention``). Each: the host time of a plan (the rows' pages and lengths
handed over before a replay; median of 20, the GPU idle) and the device time of the kernel (calls
captured in a CUDA graph, the replay timed).

    python -m benchmarks.decode_attention --out out/decode_attention.json

Prints a table last; writes every row as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.kernels import PAGE
from benchmarks.shapes import shape_config
from common.ops.attention.flashinfer_graph import FlashInferGraphAttention, workspace
from common.ops.attention.triton_graph import TritonGraphAttention

REPEATS = 50


KINDS = ("cuda-core", "tensor-core", "triton")


def _plan_for(kind: str, ws: torch.Tensor, **shape):
    if kind == "triton":
        return TritonGraphAttention(device=ws.device, **shape)
    return FlashInferGraphAttention(float_workspace=ws, tensor_cores=kind == "tensor-core",
                                    **shape)


def measure(model: str, batch: int, context: int, q_len: int, kind: str,
            ws: torch.Tensor) -> dict:
    cfg = shape_config(model)
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pages_per = -(-context // PAGE)
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    kv = torch.randn(batch * pages_per + 1, 2, PAGE, kvh, d, generator=gen,
                     device="cuda").to(torch.bfloat16)
    order = (torch.randperm(batch * pages_per, generator=torch.Generator().manual_seed(1)) + 1)
    pages = order.view(batch, pages_per).tolist()
    attn = _plan_for(kind, ws, batch_size=batch, q_len=q_len, num_qo_heads=h, num_kv_heads=kvh,
                     head_dim=d, page_size=PAGE, max_pages=batch * pages_per,
                     dtype=torch.bfloat16, scale=d ** -0.5)
    plan_us = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        attn.plan(pages, [context] * batch)
        plan_us.append((time.perf_counter() - t0) * 1e6)
    q = torch.randn(batch * q_len, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    for _ in range(3):
        attn.run(q, k_cache, v_cache)
    # REPEATS calls captured in one graph, as the decode step replays its layers: timing calls
    # one by one would measure the host's launch overhead, not a kernel of a few microseconds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            attn.run(q, k_cache, v_cache)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / REPEATS
    kv_bytes = batch * context * kvh * d * 2 * 2
    return {"model": model, "batch": batch, "context": context, "q_len": q_len, "kind": kind,
            "ms": ms, "plan_us": statistics.median(plan_us),
            "gbps": kv_bytes / (ms * 1e-3) / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/decode_attention.json")
    p.add_argument("--models", default="qwen3.5-4b,qwen3.5-35b-a3b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--q-lens", default="1,16", help="new tokens per row (16: a verify block)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode_attention needs a CUDA device", file=sys.stderr)
        return 2
    ws = workspace("cuda")
    rows = []
    for model in args.models.split(","):
        for q_len in (int(q) for q in args.q_lens.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                for context in (int(c) for c in args.contexts.split(",")):
                    for kind in KINDS:
                        if kind == "cuda-core" and q_len > 1:
                            continue  # FlashInfer's CUDA-core decode runs one token a row
                        rows.append(measure(model, batch, context, q_len, kind, ws))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print("kernel us (device, per call) and plan us (host, per plan); '-': not run")
    print(f"{'model':<16} {'q':>3} {'batch':>5} {'context':>7} "
          + " ".join(f"{k + ' us':>14}" for k in KINDS) + " "
          + " ".join(f"{k + ' plan':>16}" for k in KINDS))
    def key(r):
        return r["model"], r["q_len"], r["batch"], r["context"]

    for case in dict.fromkeys(map(key, rows)):  # in the order run
        by = {r["kind"]: r for r in rows if key(r) == case}
        cells = [f"{by[k]['ms'] * 1e3:>14.1f}" if k in by else f"{'-':>14}" for k in KINDS]
        plans = [f"{by[k]['plan_us']:>16.1f}" if k in by else f"{'-':>16}" for k in KINDS]
        print(f"{case[0]:<16} {case[1]:>3} {case[2]:>5} {case[3]:>7} " + " ".join(cells) + " "
              + " ".join(plans))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
