"""``flashsplit demo``: a router, a prefill and a decode worker on loopback, a few real prompts.

Prints each completion with its time to first token and per-token latency, checks that the
disaggregated output equals the same model run in this process (greedy, token for token), and
ends with a short ``flashsplit bench`` run on the same cluster for its summary line.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from common.sampling import SamplingParams

DEMO_PROMPTS = (
    "Hello, flashsplit!",
    "The quick brown fox",
    "Gated DeltaNet keeps a state of",
    "Prefill here, decode there:",
)


async def _run_all(address: str, prompts, params: SamplingParams):
    from router.remote import generate, request_to_pb

    return await asyncio.gather(*[generate(address, request_to_pb(text=p, params=params))
                                  for p in prompts])


def local_reference(model: str, prompts, params: SamplingParams,
                    kernels: str | None = None) -> list[list[int]]:
    """What the same model generates in this process, on the CPU with kernel set ``kernels``
    (None: the reference kernels)."""
    from common.engine.factory import EngineSettings, build_engine
    from common.tokenizer import load_tokenizer

    engine = build_engine(EngineSettings(model=model, kernels=kernels)).engine
    tokenizer = load_tokenizer(model)
    return [r.output_ids for r in engine.generate([tokenizer.encode(p) for p in prompts], params)]


def _bench(address: str, max_new_tokens: int):
    """One load point of ``flashsplit bench`` (greedy, 4 in flight) against the cluster."""
    from router.bench.config import BenchConfig, LengthDist, Load
    from router.bench.runner import run_bench

    config = BenchConfig(backend="grpc", url=address, loads=(Load(concurrency=4),),
                         num_prompts=16, input_len=LengthDist(16, 16),
                         output_len=LengthDist(max_new_tokens, max_new_tokens),
                         progress=False)
    (point,) = asyncio.run(run_bench(config)).points
    return point


def run_demo(*, model: str, max_new_tokens: int, device: str, kernels: str = "auto") -> int:
    from common.model.registry import demo_prompts_for
    from router.cluster import Cluster, ClusterConfig

    prompts = demo_prompts_for(model) or DEMO_PROMPTS  # a built-in code model gets code
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    config = ClusterConfig(model=model, worker_args=("--device", device, "--kernels", kernels),
                           echo_logs=False)
    print(f"starting router + 1 prefill + 1 decode worker on 127.0.0.1 (model {model!r}) ...",
          flush=True)
    start = time.perf_counter()
    with Cluster(config) as cluster:
        print(f"router listening on {cluster.router_address} "
              f"(ready in {time.perf_counter() - start:.1f} s)")
        for w in cluster.workers:
            print(f"  {w.name:<20} {w.address}")
        wall = time.perf_counter()
        outs = asyncio.run(_run_all(cluster.router_address, prompts, params))
        wall = time.perf_counter() - wall
        bench = _bench(cluster.router_address, max_new_tokens)
    # on the CPU, the workers' own kernel set: what is compared is the split, not two kernel
    # sets' roundings (in bf16, two logits are often one step apart)
    expected = local_reference(model, prompts, params,
                               kernels=None if str(device).startswith("cuda") else kernels)
    print()
    for prompt, out, ref in zip(prompts, outs, expected):
        itl = statistics.mean(out.inter_token_latencies_s) if out.inter_token_latencies_s else 0
        print(f"prompt {prompt!r}")
        print(f"  text   {out.text!r}")
        print(f"  tokens {len(out.token_ids)} ({out.finish_reason}), "
              f"time to first token {out.time_to_first_token_s * 1e3:.1f} ms, "
              f"per-token {itl * 1e3:.2f} ms, same as in-process: "
              f"{'yes' if out.token_ids == ref else 'NO'}")
    total = sum(len(o.token_ids) for o in outs)
    print(f"\n{len(outs)} concurrent requests, {total} tokens in {wall:.2f} s")
    s = bench.summary
    print(f"bench ({bench.load.label}, {s.completed} requests of 16 prompt and "
          f"{max_new_tokens} generated tokens): {s.output_throughput:.0f} tokens/s, time to "
          f"first token p50 {s.ttft.p50:.1f} ms / p99 {s.ttft.p99:.1f} ms, inter-token "
          f"p50 {s.itl.p50:.2f} ms / p99 {s.itl.p99:.2f} ms")
    return 0 if all(o.token_ids == r for o, r in zip(outs, expected)) else 1
