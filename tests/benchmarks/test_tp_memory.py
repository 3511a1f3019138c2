"""benchmarks/tp_memory.py: the per-rank figures of docs/tensor_parallel.md."""

from __future__ import annotations

from benchmarks.shapes import shape_config
from benchmarks.tp_memory import main, rank_cache_bytes, rank_weight_bytes


def test_ranks_split_the_weights_and_replicate_the_kv_heads(capsys):
    config = shape_config("qwen3.5-35b-a3b")
    whole = rank_weight_bytes(config, 0, 1)
    assert 69e9 < whole < 70e9  # 34.7B parameters in bf16
    halves = [rank_weight_bytes(config, r, 2) for r in range(2)]
    assert halves[0] == halves[1]
    # what every rank keeps whole (norms, routers, shared-expert gates) is well under 1%
    assert whole / 2 <= halves[0] < whole / 2 * 1.01
    kv_1, state_1 = rank_cache_bytes(config, 1)
    kv_8, state_8 = rank_cache_bytes(config, 8)
    assert kv_8 == kv_1 // 2  # 2 KV heads: one per rank from TP 2 on
    assert state_8 == state_1 // 8
    main(["--shapes", "qwen3.5-35b-a3b", "--sizes", "2"])
    assert "| qwen3.5-35b-a3b | 2 | 32.3 |" in capsys.readouterr().out
