"""Decode step time vs batch size, prefill throughput, and DFLASH draft/verify times on a GPU,
for a Qwen3.5-shaped model with random weights (4B by default; ``--shape qwen3.5-35b-a3b`` for
the MoE one, without DFLASH: the z-lab-style draft geometry is the 4B's). Decode steps are timed
in one run several ways: eager; replayed from CUDA graphs; replayed with overlap scheduling (the
host prepares step n+1 while the GPU runs step n); and, with ``--baseline OP=BACKEND``, replayed
with those ops at other backends or another kernel set, for a same-run ratio
(``linear=reference``: cuBLAS projections against our GEMV; ``sparse_moe=capturable`` on the MoE
shape; ``--baseline gpu-no-pdl``: what programmatic dependent launch gains).

Decode steps are compared with the floor memory bandwidth sets:
(weight bytes read + KV bytes read + GDN state bytes read and written) / the measured copy
bandwidth. Weight bytes read: every parameter but an untied input embedding (one row per token
is gathered); of a MoE layer's experts, only those a batch of that size picks on average with
uniform routing, ``E * (1 - (1 - k/E) ** batch)``.

    python -m benchmarks.decode [--shape qwen3.5-4b] [--kernels gpu] [--baseline linear=reference]
                                [--out out/decode.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import torch

from benchmarks.shapes import DRAFTS, shape_config
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.builtin import fill_deterministic, fill_draft_deterministic
from common.model.dflash import DFlashDraftModel
from common.model.dflash_config import DFlashConfig
from common.model.family_registry import model_class_for
from common.model.kernels import select_kernels
from common.sampling import SamplingParams

CONTEXT = 512
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def build(kernels: str, with_draft: bool, shape: str = "qwen3.5-4b"):
    if with_draft and shape not in DRAFTS:
        raise ValueError(f"no draft for the shape {shape!r}; shapes with one: {sorted(DRAFTS)}")
    config = shape_config(shape)
    with torch.device("cuda"):
        model = model_class_for(config)(config, kernels=select_kernels(kernels))
    fill_deterministic(model.named_parameters(), seed=1, device="cuda")
    draft = None
    if with_draft:
        with torch.device("cuda"):
            draft = DFlashDraftModel(DFlashConfig.from_dict(dict(DRAFTS[shape]),
                                                            target=config),
                                     dtype=model.dtype, kernels=model.kernels)
        fill_draft_deterministic(draft.named_parameters(), seed=2, device="cuda")
    return model.eval(), draft


def add_dflash_step_flags(p: argparse.ArgumentParser) -> None:
    """The flags of how a greedy DFLASH step runs in graphs, against their baselines
    (``CudaGraphConfig``'s ``commit_graphs``, ``draft_ahead``, ``verify_ahead``)."""
    p.add_argument("--no-commit-graphs", dest="commit_graphs", action="store_false",
                   help="launch a greedy DFLASH step's acceptance and GDN commit one by one "
                        "(the baseline of the commit graphs)")
    p.add_argument("--draft-ahead", action="store_true",
                   help="launch each DFLASH step's draft before the previous step is read "
                        "(CudaGraphConfig.draft_ahead)")
    p.add_argument("--verify-ahead", action="store_true",
                   help="launch each DFLASH step's draft and verify before the previous step "
                        "is read (CudaGraphConfig.verify_ahead; needs attention plans that take "
                        "lengths on the device: --kernels gpu-triton-attention)")


def engine_for(model, draft, *, block_size=None, max_running=256, graphs=False, overlap=False,
               device="cuda", commit_graphs=True, draft_ahead=False, verify_ahead=False):
    """An engine on ``device`` (the GPU by default); with ``graphs`` its CUDA graphs are
    captured before it returns (``commit_graphs``, ``draft_ahead``, ``verify_ahead``:
    ``CudaGraphConfig``'s)."""
    cache = CacheConfig(page_size=16, num_pages=max_running * (CONTEXT + 160) // 16 + 64,
                        num_slots=max_running + 1)
    sched = SchedulerConfig(max_prefill_tokens=16384, max_running_requests=max_running)
    config = EngineConfig(cache=cache, scheduler=sched, device=device,
                          cuda_graph=CudaGraphConfig(enabled=graphs, commit_graphs=commit_graphs,
                                                     draft_ahead=draft_ahead,
                                                     verify_ahead=verify_ahead),
                          overlap_schedule=overlap)
    engine = LLMEngine(model, config, draft=draft, block_size=block_size)
    if graphs:
        engine.warmup()
    return engine


def fill_batch(engine, batch: int, prompt_len: int, new_tokens: int,
               vocab: int | None = None) -> list:
    """Add ``batch`` random prompts and run their prefill; returns the requests."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    high = vocab or 240000
    reqs = [engine.add_request(torch.randint(0, high, (prompt_len,), generator=gen).tolist(),
                               params) for _ in range(batch)]
    while any(r.is_prefilling for r in reqs):
        engine.step()
    return reqs


def timed(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def copy_bandwidth() -> float:
    """Bytes moved per second by a device copy (each byte read once and written once)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10)


def weight_bytes_read(model, batch: int) -> float:
    """Bytes of weights one decode step of ``batch`` tokens reads (see the module docstring)."""
    c = model.config
    embedding = model.get_input_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():
        if p is embedding and not c.tie_word_embeddings:
            continue
        size = p.numel() * p.element_size()
        if ".experts." in name:  # packed [E, ...]: the experts a batch picks, on average
            e, k = c.num_experts, c.num_experts_per_tok
            size *= 1 - (1 - k / e) ** batch
        total += size
    return total


def decode_floor_s(model, batch: int, context: int, bandwidth: float) -> float:
    weights = weight_bytes_read(model, batch)
    c = model.config
    kv_per_token = len(c.full_attention_layers) * 2 * c.num_key_value_heads * c.head_dim * 2
    state = len(c.linear_attention_layers) * (c.linear_num_value_heads * c.linear_key_head_dim
                                              * c.linear_value_head_dim * 4
                                              + c.conv_dim * (c.linear_conv_kernel_dim - 1) * 2)
    return (weights + batch * (context * kv_per_token + 2 * state)) / bandwidth


@contextlib.contextmanager
def kernels_of(model, kernels):
    """The model runs ``kernels`` inside (graphs captured inside keep them)."""
    kept, model.kernels = model.kernels, kernels
    try:
        yield
    finally:
        model.kernels = kept


def baseline_kernels(model, spec: str):
    """The model's kernels with some ops at other backends, from ``op=backend[,op=backend]``
    (registry names; e.g. ``linear=reference``: every projection on cuBLAS), or a whole kernel
    set by name (e.g. ``gpu-no-pdl``: the ``gpu`` set without PDL)."""
    from common.model.kernels import MODEL_OPS
    from common.ops.registry import default_registry

    if "=" not in spec:
        return select_kernels(spec)
    registry, chosen = default_registry(), dict(model.kernels.backends)
    replace = {}
    for item in spec.split(","):
        op, _, backend = item.partition("=")
        if op not in MODEL_OPS or not backend:
            raise ValueError(f"--baseline: {item!r} is not OP=BACKEND for a model op "
                             f"({', '.join(sorted(MODEL_OPS))})")
        replace[op] = registry.get(op, backend)
        chosen[op] = backend
    return dataclasses.replace(model.kernels, **replace, backends=tuple(chosen.items()))


def bench_decode(model, bandwidth, batches, baseline: str = "") -> list[dict]:
    """Engine decode steps (schedule, forward, sample) per batch size: eager, from graphs, from
    graphs with overlap scheduling, and (``baseline``, see :func:`baseline_kernels`) from graphs
    with some ops at other backends."""
    modes = {"eager": (model.kernels, False, False), "graph": (model.kernels, True, False),
             "overlap": (model.kernels, True, True)}
    if baseline:
        modes["baseline"] = (baseline_kernels(model, baseline), True, False)
    engines = {}
    for mode, (kernels, graphs, overlap) in modes.items():
        with kernels_of(model, kernels):
            engines[mode] = engine_for(model, None, max_running=max(batches), graphs=graphs,
                                       overlap=overlap)
    rows = []
    for batch in batches:
        floor = decode_floor_s(model, batch, CONTEXT + 5, bandwidth)
        row = {"batch": batch, "floor_ms": floor * 1e3}
        for mode, engine in engines.items():
            with kernels_of(model, modes[mode][0]):
                reqs = fill_batch(engine, batch, CONTEXT, 64)
                engine.step()  # warm-up at this batch size
                step_s = timed(engine.step, 8)
                for r in reqs:
                    engine.abort(r.request_id)
                while engine.has_work():  # an overlapped step still in flight
                    engine.step()
            row.update({f"{mode}_ms": step_s * 1e3, f"{mode}_x_floor": step_s / floor,
                        f"{mode}_tokens_per_s": batch / step_s})
        rows.append(row)
    del engines
    torch.cuda.empty_cache()
    return rows


def bench_prefill(model, counts, prompt_len=2048) -> list[dict]:
    rows = []
    for n in counts:
        engine = engine_for(model, None, max_running=max(counts))
        # warm-up at the timed shape: a new batch shape can compile kernel variants (run 7 of
        # 2026-12-01 timed 6.3 s for 4 prompts after a one-prompt warm-up, 0.46 s for 16)
        fill_batch(engine, n, prompt_len, 1)
        start = time.perf_counter()
        fill_batch(engine, n, prompt_len, 1)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append({"prompts": n, "prompt_len": prompt_len, "seconds": seconds,
                     "tokens_per_s": n * prompt_len / seconds})
        del engine
        torch.cuda.empty_cache()
    return rows


def bench_dflash(model, draft, block_sizes, batches, graphs=True) -> list[dict]:
    """Draft and verify time per DFLASH step (engine steps, graphs on by default)."""
    rows = []
    for b in block_sizes:
        for batch in batches:
            engine = engine_for(model, draft, block_size=b, max_running=max(batches),
                                graphs=graphs)
            spec = engine.speculator
            reqs = fill_batch(engine, batch, CONTEXT, 200)
            engine.step()  # warm-up step
            draft_s = timed(lambda: spec.propose(reqs, [r.page_ids for r in reqs]), 5)
            step_s = timed(engine.step, 5)
            # verify = the rest of the step: target verify, acceptance, commit, draft context
            rows.append({"block_size": b, "batch": batch, "graphs": graphs,
                         "draft_ms": draft_s * 1e3, "verify_ms": (step_s - draft_s) * 1e3,
                         "step_ms": step_s * 1e3,
                         "draft_over_verify": draft_s / (step_s - draft_s)})
            del engine
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="gpu")
    p.add_argument("--shape", default="qwen3.5-4b", help="a benchmarks/shapes.py name")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--out", default="out/decode.json")
    p.add_argument("--parts", default="decode,prefill,dflash",
                   help="comma-separated parts to run: decode, prefill, dflash")
    p.add_argument("--baseline", default="", metavar="OP=BACKEND[,...]|SET",
                   help="also time decode graphs with these ops at these backends, or with "
                        "another kernel set, for a same-run ratio (linear=reference: cuBLAS "
                        "projections; gpu-no-pdl: without PDL)")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    parts = set(args.parts.split(","))
    model, draft = build(args.kernels, with_draft="dflash" in parts, shape=args.shape)
    bandwidth = copy_bandwidth()
    baseline = args.baseline
    decode = bench_decode(model, bandwidth, batches, baseline) if "decode" in parts else []
    prefill = bench_prefill(model, [1, 4, 16, 32]) if "prefill" in parts else []
    dflash = []
    if "dflash" in parts:
        dflash = bench_dflash(model, draft, [8, 16], [1, 8], graphs=True)
        dflash += bench_dflash(model, draft, [16], [1, 8], graphs=False)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "kernels": args.kernels,
                               "shape": args.shape, "baseline": baseline,
                               "device": torch.cuda.get_device_name(),
                               "copy_GBps": bandwidth / 1e9, "decode": decode,
                               "prefill": prefill, "dflash": dflash}, indent=2))
    print(f"{args.shape}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read+write); context "
          f"{CONTEXT} tokens")
    base = f" {'base ms':>9} {'base/graph':>10}" if baseline else ""
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'overlap':>9} {'floor ms':>9} "
          f"{'eager/fl':>9} {'graph/fl':>9} {'overlap/fl':>10} {'graph tok/s':>12}{base}")
    for r in decode:
        base = (f" {r['baseline_ms']:>9.2f} {r['baseline_ms'] / r['graph_ms']:>10.3f}"
                if baseline else "")
        print(f"{r['batch']:>5} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
              f"{r['overlap_ms']:>9.2f} {r['floor_ms']:>9.3f} {r['eager_x_floor']:>9.1f} "
              f"{r['graph_x_floor']:>9.2f} {r['overlap_x_floor']:>10.2f} "
              f"{r['graph_tokens_per_s']:>12.0f}{base}")
    if baseline:
        print(f"base: the same graphs with {baseline}")
    print(f"{'prompts':>7} {'x tokens':>9} {'seconds':>8} {'tok/s':>9}")
    for r in prefill:
        print(f"{r['prompts']:>7} {r['prompt_len']:>9} {r['seconds']:>8.3f} "
              f"{r['tokens_per_s']:>9.0f}")
    print(f"{'B':>3} {'batch':>5} {'graphs':>6} {'draft ms':>9} {'verify ms':>10} "
          f"{'draft/verify':>13}")
    for r in dflash:
        print(f"{r['block_size']:>3} {r['batch']:>5} {str(r['graphs']):>6} {r['draft_ms']:>9.2f} "
              f"{r['verify_ms']:>10.2f} {r['draft_over_verify']:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
