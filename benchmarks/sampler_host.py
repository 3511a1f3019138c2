"""Host time of the sampler's draw for sampled rows, seeded (every request that comes through
the router) and on the default RNG, beside a draw of ``torch.multinomial`` per seeded row (how
seeded rows were drawn before the exponential race), in the same run; and of DFLASH's
acceptance of sampled rows (blocks of ``--block``), the batch at once beside row by row (one
host read each, as it was done before).

    python -m benchmarks.sampler_host [--rows 1,32,128,256] [--vocab 64,8192] [--device cpu]

A small vocabulary shows the per-row cost of launching work (what a GPU step pays on the host);
a large one adds the draw's own compute. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common.engine.acceptance import accept_sampled, accept_sampled_rows
from common.engine.sampler import Sampler, filtered_probs, make_generator
from common.sampling import SamplingParams


def _per_row_multinomial(probs: torch.Tensor, generators) -> torch.Tensor:
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for j, gen in enumerate(generators):
        out[j] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return out


def _ms(fn, repeats: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(rows: int, vocab: int, device: torch.device, repeats: int) -> dict:
    logits = torch.randn(rows, vocab, device=device)
    seeded = [SamplingParams(temperature=0.7, seed=i) for i in range(rows)]
    unseeded = [SamplingParams(temperature=0.7)] * rows
    generators = [make_generator(i, device) for i in range(rows)]
    sampler = Sampler()
    probs = filtered_probs(logits, seeded)
    return {
        "rows": rows, "vocab": vocab,
        "seeded_ms": _ms(lambda: sampler.sample(logits, seeded, generators), repeats, device),
        "unseeded_ms": _ms(lambda: sampler.sample(logits, unseeded, [None] * rows), repeats,
                           device),
        # the draw alone, without the filtering both paths share
        "per_row_multinomial_ms": _ms(lambda: _per_row_multinomial(probs, generators), repeats,
                                      device),
    }


def measure_acceptance(rows: int, vocab: int, block: int, device: torch.device,
                       repeats: int) -> dict:
    logits = torch.randn(rows, block, vocab, device=device)
    drafts = torch.randint(0, vocab, (rows, block - 1), device=device)
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(rows)]
    generators = [make_generator(i, device) for i in range(rows)]

    def row_by_row():
        return [accept_sampled(drafts[i], logits[i], params[i], generators[i])
                for i in range(rows)]

    return {"rows": rows, "vocab": vocab, "block": block,
            "batch_ms": _ms(lambda: accept_sampled_rows(drafts, logits, params, generators),
                            repeats, device),
            "row_by_row_ms": _ms(row_by_row, repeats, device)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,32,128,256")
    p.add_argument("--vocab", default="64,8192")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--block", type=int, default=16, help="DFLASH block size (0: skip acceptance)")
    p.add_argument("--out", default="out/sampler_host.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results = [measure(n, v, device, args.repeats)
               for v in map(int, args.vocab.split(",")) for n in map(int, args.rows.split(","))]
    accepts = [measure_acceptance(n, v, args.block, device, args.repeats)
               for v in map(int, args.vocab.split(",")) for n in map(int, args.rows.split(","))
               ] if args.block > 1 else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": str(device), "torch_threads": torch.get_num_threads(),
                               "rows": results, "acceptance": accepts}, indent=2))
    if accepts:
        print(f"DFLASH acceptance of sampled rows, block {args.block}")
        print(f"{'rows':>5} {'vocab':>7} {'batch ms':>9} {'row by row ms':>14} {'x batch':>8}")
        for r in accepts:
            print(f"{r['rows']:>5} {r['vocab']:>7} {r['batch_ms']:>9.3f} "
                  f"{r['row_by_row_ms']:>14.3f} {r['row_by_row_ms'] / r['batch_ms']:>7.2f}x")
        print("sampler")
    print(f"{'rows':>5} {'vocab':>7} {'seeded ms':>10} {'unseeded ms':>12} "
          f"{'multinomial/row ms':>19} {'x seeded':>9}")
    for r in results:
        print(f"{r['rows']:>5} {r['vocab']:>7} {r['seeded_ms']:>10.3f} {r['unseeded_ms']:>12.3f} "
              f"{r['per_row_multinomial_ms']:>19.3f} "
              f"{r['per_row_multinomial_ms'] / r['seeded_ms']:>8.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
