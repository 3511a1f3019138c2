"""What one rank of a tensor-parallel group holds and sends, for the released geometries
(``benchmarks/shapes.py``), computed from the model itself: each rank's shard is built on the
meta device (no memory) from its ShardPlan and its parameters are counted.

    python -m benchmarks.tp_memory                 # the table of docs/tensor_parallel.md
    python -m benchmarks.tp_memory --sizes 1,2,4,8 --shapes qwen3.5-35b-a3b
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.shapes import SHAPES, shape_config
from common.config import ModelConfig
from common.model.family_registry import model_class_for
from common.parallel.group import TensorParallelGroup

GIB = 1024 ** 3
DEFAULT_SHAPES = ("qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b")


def rank_weight_bytes(config: ModelConfig, rank: int, world_size: int,
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of rank ``rank``'s parameters (A_log is fp32 whatever ``dtype``)."""
    stand_in = object()
    tp = None if world_size == 1 else TensorParallelGroup(rank, world_size, stand_in, stand_in)
    with torch.device("meta"):
        model = model_class_for(config)(config, dtype=dtype, tp=tp)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rank_cache_bytes(config: ModelConfig, world_size: int, kv_bytes: int = 2) -> tuple[int, int]:
    """(KV bytes per token, GDN state bytes per request) one rank holds: its KV heads of every
    full-attention layer, and its conv channels (model dtype) and fp32 recurrent state of every
    GDN layer."""
    from common.parallel.shard_plan import ShardPlan

    plan = ShardPlan.for_rank(config, 0, world_size)
    c = config
    kv = len(c.full_attention_layers) * 2 * plan.attention.num_groups * c.head_dim * kv_bytes
    conv = plan.gdn_conv_dim * (c.linear_conv_kernel_dim - 1) * kv_bytes
    ssm = plan.gdn.num_heads * c.linear_value_head_dim * c.linear_key_head_dim * 4
    return kv, len(c.linear_attention_layers) * (conv + ssm)


def collective_bytes_per_token(config: ModelConfig, act_bytes: int = 2) -> dict[str, int]:
    """Bytes each rank contributes per token to each collective of one forward (independent
    of the group size; a ring all-reduce moves about 2·(N-1)/N times this over each link)."""
    h = config.hidden_size
    return {"all-reduce per layer (mixer + MLP)": 2 * h * act_bytes,
            "embedding all-reduce": h * act_bytes,
            "logits all-gather per sampled row (fp32)": config.vocab_size * 4}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"comma-separated names of {sorted(SHAPES)}")
    p.add_argument("--sizes", default="2,4,8", help="tensor-parallel sizes")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| model | TP | weights per rank (GiB) | KV per token per rank (KiB) "
          "| GDN state per request per rank (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.shapes.split(","):
        config = shape_config(name)
        total = rank_weight_bytes(config, 0, 1)
        print(f"| {name} | 1 | {total / GIB:.1f} | "
              f"{rank_cache_bytes(config, 1)[0] / 1024:.1f} | "
              f"{rank_cache_bytes(config, 1)[1] / 2**20:.2f} |")
        for n in sizes:
            weights = max(rank_weight_bytes(config, r, n) for r in range(n))
            kv, state = rank_cache_bytes(config, n)
            print(f"| {name} | {n} | {weights / GIB:.1f} | {kv / 1024:.1f} | "
                  f"{state / 2**20:.2f} |")
    for name in args.shapes.split(","):
        print(name, collective_bytes_per_token(shape_config(name)))


if __name__ == "__main__":
    main()
