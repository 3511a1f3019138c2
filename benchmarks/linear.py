"""Projections at decode sizes: cuBLAS (``F.linear``) against our Triton GEMV, per layer shape.

For every dense weight shape of the chosen models and every row count M, times cuBLAS, the
Triton kernel with the tile ``config_for`` picks, and (``--sweep``) the best of a tile sweep. Each
call reads a different copy of the weight (copies enough to overflow the 50 MB L2), and
``REPEATS`` calls are captured in one CUDA graph, so the time is the kernel's, not the host's.
The last lines add up one batch-1 decode step's projections both ways.

    python -m benchmarks.linear --rows 1,2,4,8,16 --sweep --out out/linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import us_per_call
from benchmarks.shapes import shape_config
from common.ops.linear.triton import GemvConfig, config_for, uses_triton
from common.ops.linear.triton import linear as triton_linear

REPEATS = 40
_MIN_BYTES = 256 << 20  # weight copies per case: together well past the L2


def layer_shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """Projection name -> (N, K, uses per decode step) for one model geometry."""
    c = shape_config(model)
    h = c.hidden_size
    attn = len(c.full_attention_layers)
    gdn = c.num_hidden_layers - attn
    shapes = {
        "gdn.in_proj": (c.conv_dim + c.value_dim + 2 * c.linear_num_value_heads, h, gdn),
        "gdn.out_proj": (h, c.value_dim, gdn),
        "attn.qkv_proj": (c.num_attention_heads * c.head_dim * 2
                          + 2 * c.num_key_value_heads * c.head_dim, h, attn),
        "attn.o_proj": (h, c.num_attention_heads * c.head_dim, attn),
        "lm_head": (c.vocab_size, h, 1),
    }
    if c.num_experts:
        i = c.shared_expert_intermediate_size
        shapes["shared.gate_up"] = (2 * i, h, c.num_hidden_layers)
        shapes["shared.down"] = (h, i, c.num_hidden_layers)
    else:
        shapes["mlp.gate_up"] = (2 * c.intermediate_size, h, c.num_hidden_layers)
        shapes["mlp.down"] = (h, c.intermediate_size, c.num_hidden_layers)
    return shapes


def time_calls(fn, weights, x) -> float:
    """Microseconds per call, ``REPEATS`` calls over the weight copies replayed from a graph."""
    return us_per_call(lambda i: fn(x, weights[i % len(weights)]), REPEATS)


def sweep_configs(rows: int) -> list[GemvConfig]:
    if rows > 4:
        return [GemvConfig(n, k, w) for n, k, w in itertools.product((16, 32, 64), (64, 128, 256),
                                                                      (4, 8))]
    bm = 1 << (rows - 1).bit_length()
    return [GemvConfig(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8, 16),
                                                                 (256, 512, 1024), (4, 8))
            if bm * n * k <= 16384]


def measure(name: str, n: int, k: int, rows: int, sweep: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k * 7 + rows)
    nbytes = n * k * 2
    copies = max(1, -(-_MIN_BYTES // nbytes))
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    # the Triton kernel with config_for's tile, also where the op's routing picks cuBLAS
    cfg = config_for(rows, n, k)
    want = F.linear(x.float(), weights[0].float())
    got = triton_linear(x=x, weight=weights[0], config=cfg)
    err = ((got.float() - want).norm() / want.norm()).item()
    cublas = time_calls(lambda a, w: F.linear(a, w), weights, x)
    ours = time_calls(lambda a, w: triton_linear(x=a, weight=w, config=cfg), weights, x)
    row = {"shape": name, "n": n, "k": k, "rows": rows, "cublas_us": cublas, "triton_us": ours,
           "config": vars(cfg), "routed_to_triton": uses_triton(rows, n), "rel_err": err,
           "cublas_gbps": nbytes / cublas / 1e3, "triton_gbps": nbytes / ours / 1e3}
    if sweep:
        best = (ours, cfg)
        for c in sweep_configs(rows):
            t = time_calls(lambda a, w, c=c: triton_linear(x=a, weight=w, config=c), weights, x)
            best = min(best, (t, c), key=lambda p: p[0])
        row.update(best_us=best[0], best_config=vars(best[1]))
    del weights
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3.5-4b,qwen3.5-35b-a3b")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--sweep", action="store_true", help="also time a sweep of tiles")
    p.add_argument("--out", default="out/linear.json")
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    results, step = [], {}
    for model in args.models.split(","):
        for name, (n, k, uses) in layer_shapes(model).items():
            for rows in rows_list:
                r = measure(name, n, k, rows, args.sweep)
                r["model"], r["uses"] = model, uses
                results.append(r)
                print(json.dumps(r), flush=True)
                if rows == 1:
                    s = step.setdefault(model, [0.0, 0.0, 0.0])
                    s[0] += uses * r["cublas_us"]
                    s[1] += uses * r["triton_us"]
                    s[2] += uses * n * k * 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": results, "step_at_batch_1": step}, indent=1))
    print(f"\n{'model':16} {'shape':15} {'M':>3} {'cuBLAS us':>10} {'GB/s':>6} {'Triton us':>10} "
          f"{'GB/s':>6} {'ratio':>6} {'best us':>8} best tile")
    for r in results:
        best = (f"{r['best_us']:8.1f} {r['best_config']}" if "best_us" in r else "")
        print(f"{r['model']:16} {r['shape']:15} {r['rows']:3d} {r['cublas_us']:10.1f} "
              f"{r['cublas_gbps']:6.0f} {r['triton_us']:10.1f} {r['triton_gbps']:6.0f} "
              f"{r['cublas_us'] / r['triton_us']:6.2f} {best}")
    for model, (cb, tr, nbytes) in step.items():
        print(f"{model}: batch-1 step projections cuBLAS {cb / 1e3:.3f} ms, Triton "
              f"{tr / 1e3:.3f} ms ({nbytes / 1e9:.2f} GB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
