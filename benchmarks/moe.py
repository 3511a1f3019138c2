"""The sparse MoE block at decode sizes: each capturable backend, one layer of the chosen shape.

Times the registry's ``capturable`` and ``triton`` backends of ``sparse_moe`` (and, with
``--also module:function``, any function of the same contract, e.g. an earlier version kept
outside the tree) at 1..32 tokens. Each call reads a different copy of the layer's weights
(enough copies to overflow the 50 MB L2, as a decode step's 40 layers do), and ``REPEATS``
calls are replayed from one CUDA graph, so the time is the kernels', not the host's. The floor
column is the bytes a call must read (router, the experts the tokens pick, the shared expert)
over ``--bandwidth`` GB/s.

    python -m benchmarks.moe --tokens 1,8,32 --out out/moe.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from benchmarks.graph_timing import us_per_call
from benchmarks.shapes import shape_config
from common.ops.registry import default_registry

REPEATS = 24
_MIN_BYTES = 4 << 30  # weight copies: each call's picked experts are far from the L2's 50 MB


def layer_weights(cfg, copies: int, seed: int = 0) -> list[dict]:
    """``copies`` sets of one MoE layer's weights (bf16, scaled like trained ones)."""
    h, e, i, s = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                  cfg.shared_expert_intermediate_size)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, device="cuda") * fan_in ** -0.5).to(torch.bfloat16)

    return [dict(router_weight=r(e, h, fan_in=h), experts_gate_up=r(e, 2 * i, h, fan_in=h),
                 experts_down=r(e, h, i, fan_in=i), shared_gate_proj=r(s, h, fan_in=h),
                 shared_up_proj=r(s, h, fan_in=h), shared_down_proj=r(h, s, fan_in=s),
                 shared_expert_gate=r(1, h, fan_in=h)) for _ in range(copies)]


def bytes_read(cfg, tokens: int) -> int:
    """Weight bytes one call reads at least: router, shared expert, and the distinct experts
    ``tokens`` tokens pick on average when each picks ``k`` of ``E`` uniformly."""
    h, e, i, s, k = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size, cfg.num_experts_per_tok)
    distinct = e * (1 - (1 - k / e) ** tokens)
    return int(2 * (e * h + distinct * 3 * i * h + 3 * s * h + h))


def time_calls(fn, layers: list[dict], x: torch.Tensor, top_k: int) -> float:
    """Microseconds per call, ``REPEATS`` calls over the weight copies replayed from a graph."""
    return us_per_call(lambda i: fn(x=x, top_k=top_k, norm_topk_prob=True,
                                    **layers[i % len(layers)]), REPEATS)


def implementations(also: list[str]) -> dict:
    registry = default_registry()
    impls = {b: registry.get("sparse_moe", b) for b in ("capturable", "triton")}
    for spec in also:
        module, _, attr = spec.partition(":")
        impls[spec] = getattr(importlib.import_module(module), attr or "sparse_moe")
    return impls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-35b-a3b", help="a benchmarks/shapes.py MoE shape")
    p.add_argument("--tokens", default="1,8,32")
    p.add_argument("--also", default="", help="comma-separated module:function to time too")
    p.add_argument("--bandwidth", type=float, default=4200.0,
                   help="GB/s for the floor (a device copy's read+write rate on H200)")
    p.add_argument("--out", default="out/moe.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.moe needs a CUDA device", file=sys.stderr)
        return 2
    cfg = shape_config(args.shape)
    if not cfg.num_experts:
        p.error(f"{args.shape} has no experts")
    impls = implementations([a for a in args.also.split(",") if a])
    per_copy = bytes_read(cfg, cfg.num_experts)  # every expert: the copy's whole size
    layers = layer_weights(cfg, max(2, -(-_MIN_BYTES // per_copy)))
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = (torch.randn(tokens, cfg.hidden_size, generator=torch.Generator(device="cuda")
                         .manual_seed(tokens), device="cuda")).to(torch.bfloat16)
        floor_us = bytes_read(cfg, tokens) / (args.bandwidth * 1e3)
        row = {"tokens": tokens, "floor_us": floor_us}
        with torch.inference_mode():
            for name, fn in impls.items():
                row[name] = time_calls(fn, layers, x, cfg.num_experts_per_tok)
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name(),
                               "copies": len(layers), "rows": rows}, indent=1))
    names = list(impls)
    print(f"{args.shape}: µs per MoE layer call, {len(layers)} weight copies, "
          f"{REPEATS} calls per graph")
    print(f"{'tokens':>6} " + " ".join(f"{n[-24:]:>24}" for n in names) + f" {'floor':>8}")
    for row in rows:
        print(f"{row['tokens']:>6} " + " ".join(f"{row[n]:>24.1f}" for n in names)
              + f" {row['floor_us']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
