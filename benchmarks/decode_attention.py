"""FlashInfer's graph-mode decode attention: CUDA-core kernel against tensor-core kernel.

The decode step replays ``FlashInferGraphAttention`` once per full-attention layer; which of
FlashInfer's two decode kernels it uses is ``decode_uses_tensor_cores``. This times both in the
same run, on Qwen3.5 layer shapes (heads, KV heads, head dim from ``benchmarks/shapes.py``), for
a few batch sizes and context lengths: plan once, capture calls in a CUDA graph, time its replay.

    python -m benchmarks.decode_attention --out out/decode_attention.json

Prints a table last; writes every row as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.kernels import PAGE
from benchmarks.shapes import shape_config
from common.ops.attention.flashinfer_graph import FlashInferGraphAttention, workspace

REPEATS = 50


def measure(model: str, batch: int, context: int, tensor_cores: bool, ws: torch.Tensor) -> dict:
    cfg = shape_config(model)
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pages_per = -(-context // PAGE)
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    kv = torch.randn(batch * pages_per + 1, 2, PAGE, kvh, d, generator=gen,
                     device="cuda").to(torch.bfloat16)
    order = (torch.randperm(batch * pages_per, generator=torch.Generator().manual_seed(1)) + 1)
    pages = order.view(batch, pages_per).tolist()
    attn = FlashInferGraphAttention(batch_size=batch, q_len=1, num_qo_heads=h, num_kv_heads=kvh,
                                    head_dim=d, page_size=PAGE, max_pages=batch * pages_per,
                                    dtype=torch.bfloat16, scale=d ** -0.5, float_workspace=ws,
                                    tensor_cores=tensor_cores)
    attn.plan(pages, [context] * batch)
    q = torch.randn(batch, h, d, generator=gen, device="cuda").to(torch.bfloat16)
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
    return {"model": model, "batch": batch, "context": context, "tensor_cores": tensor_cores,
            "ms": ms, "gbps": kv_bytes / (ms * 1e-3) / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/decode_attention.json")
    p.add_argument("--models", default="qwen3.5-4b,qwen3.5-35b-a3b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="512,4096")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode_attention needs a CUDA device", file=sys.stderr)
        return 2
    ws = workspace("cuda")
    rows = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                for tc in (False, True):
                    rows.append(measure(model, batch, context, tc, ws))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    print(f"{'model':<16} {'batch':>5} {'context':>7} {'cuda-core us':>12} {'tensor-core us':>14} "
          f"{'ratio':>6}")
    for i in range(0, len(rows), 2):
        cc, tc = rows[i], rows[i + 1]
        print(f"{cc['model']:<16} {cc['batch']:>5} {cc['context']:>7} {cc['ms'] * 1e3:>12.1f} "
              f"{tc['ms'] * 1e3:>14.1f} {cc['ms'] / tc['ms']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
