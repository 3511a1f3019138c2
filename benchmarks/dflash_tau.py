"""Mean accept length τ of a DFLASH draft on held-out text, greedy and sampled, per block size;
and, with ``--speed-batches``, in-process decode tokens/s with the draft against without.

Prompts are evenly spaced windows of ``--prompt-tokens`` tokens of the held-out data (the
corpus's ``eval.jsonl``); each is continued for ``--max-new-tokens`` tokens by the engine with
the draft at each block size and temperature. τ = tokens committed per DFLASH step (accepted
drafts + 1), averaged over every step of every prompt. Sampling is lossless (rejection
sampling against the greedy drafts), seeded per prompt. For greedy runs the outputs are also
compared with the engine's output without speculation ("identical": the share of prompts whose
tokens are the same).

Speed: for each batch size b, b prompts run to completion at once, with and without the draft
(block size: the largest of ``--blocks``), after a warm-up that captures the CUDA graphs;
tokens/s counts output tokens over the wall time of the whole run (prefill included); "decode
x" is the ratio of decode alone: the tokens after every request of a batch has its first one,
over the time after that (what a split's decode worker does; `benchmarks.dflash_serving`'s
"decode x" is the same ratio from the streams' time per output token).

    python -m benchmarks.dflash_tau --model pycoder --draft pycoder --data CORPUS/eval.jsonl \
        [--blocks 8,16] [--temperatures 0,0.7] [--num-prompts 64] [--device cuda] \
        [--speed-batches 1,8,32] [--json out/tau.json]

Prints the table last; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.decode import add_dflash_step_flags
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.sampling import SamplingParams


@dataclass(frozen=True)
class TauConfig:
    model: str
    draft: str
    data: str
    blocks: tuple[int, ...] = (8, 16)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    num_prompts: int = 64
    prompt_tokens: int = 128
    max_new_tokens: int = 128
    speed_batches: tuple[int, ...] = ()
    device: str = "cpu"
    kernels: str = "auto"
    seed: int = 0
    # None: the checkpoint's own (bf16 for the built-in pair). float32 takes bf16's one-ulp
    # ties out of the greedy comparison: in bf16 two logits of a flat distribution are often
    # equal, and which one wins then depends on rounding that differs between a verify
    # forward of a block and a decode step
    dtype: str | None = None
    # CudaGraphConfig.commit_graphs: False launches a greedy step's acceptance and commit one
    # by one after the verify graph (the baseline of the commit graphs)
    commit_graphs: bool = True
    # CudaGraphConfig.draft_ahead: True launches each step's draft before the previous step
    # is read (against the default, drafting after the read)
    draft_ahead: bool = False
    # CudaGraphConfig.verify_ahead: True launches each step's draft and verify before the
    # previous step is read (needs --kernels gpu-triton-attention)
    verify_ahead: bool = False


@dataclass
class TauRow:
    block_size: int
    temperature: float
    tau: float
    steps: int
    tokens: int
    identical: float | None = None  # greedy only: share of prompts equal to plain decoding


@dataclass
class SpeedRow:
    """Tokens/s each way: whole requests (prefill included) and decode alone (the tokens
    after every request of a batch has its first one, over the time after that)."""

    batch: int
    block_size: int
    plain_tokens_per_s: float
    dflash_tokens_per_s: float
    tau: float
    plain_decode_tokens_per_s: float = 0.0
    dflash_decode_tokens_per_s: float = 0.0
    # DFLASH steps after every request had its first token: per batch (the engine's) against
    # per request (its own). A batch runs whole to its end, so where the first is well above
    # the second its slowest rows set its time, which a server refilling slots does not pay
    dflash_batch_steps: float = 0.0
    dflash_row_steps: float = 0.0

    @property
    def speedup(self) -> float:
        return self.dflash_tokens_per_s / self.plain_tokens_per_s

    @property
    def decode_speedup(self) -> float:
        if not self.plain_decode_tokens_per_s:
            return float("nan")
        return self.dflash_decode_tokens_per_s / self.plain_decode_tokens_per_s


@dataclass
class Timed:
    """One batch run to its end: all of it, and its decode part (after its last first token)."""

    requests: list
    seconds: float
    decode_tokens: int
    decode_seconds: float
    decode_steps: int = 0  # engine steps after every request had its first token


def timed_generate(engine: LLMEngine, prompts, params: SamplingParams,
                    on_gpu: bool) -> Timed:
    """``engine.generate`` stepped by hand, noting when every request has its first token
    (a step's tokens are on the host when :meth:`LLMEngine.step` returns)."""
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    decode_from, tokens_before, decode_steps = None, 0, 0
    while engine.scheduler.num_requests:
        if not engine.has_work():
            raise RuntimeError("requests are waiting for room that nothing will free")
        engine.step()
        if decode_from is not None:
            decode_steps += 1
        elif all(r.output_ids for r in reqs):
            decode_from = time.perf_counter()
            tokens_before = sum(len(r.output_ids) for r in reqs)
    if on_gpu:
        torch.cuda.synchronize()
    end = time.perf_counter()
    total = sum(len(r.output_ids) for r in reqs)
    decode_from = end if decode_from is None else decode_from
    return Timed(reqs, end - start, total - tokens_before, end - decode_from, decode_steps)


@dataclass
class TauReport:
    config: TauConfig
    rows: list[TauRow] = field(default_factory=list)
    speed: list[SpeedRow] = field(default_factory=list)


class _Engines:
    """One engine per block size (None: no draft), each made once, pools sized for the
    prompts. They share the target, so :meth:`get` also sets its capture: the plain engine
    runs (and captures its graphs) without the draft's hidden-state capture."""

    def __init__(self, config: TauConfig, target, draft, eos) -> None:
        self.config, self.target, self.draft, self.eos = config, target, draft, eos
        self._made: dict[int | None, LLMEngine] = {}

    def get(self, block: int | None) -> LLMEngine:
        self.target.set_dflash_layers_to_capture(
            self.draft.config.target_layer_ids if block else ())
        if block not in self._made:
            c = self.config
            running = max([c.num_prompts, *c.speed_batches])
            per_request = c.prompt_tokens + c.max_new_tokens + max(c.blocks) + 16
            cache = CacheConfig(page_size=16, num_pages=1 + running * (-(-per_request // 16)),
                                num_slots=1 + running)
            engine = LLMEngine(
                self.target, EngineConfig(
                    cache=cache, device=c.device,
                    scheduler=SchedulerConfig(max_running_requests=running,
                                              max_prefill_tokens=max(2048, c.prompt_tokens)),
                    cuda_graph=CudaGraphConfig(max_batch_size=running,
                                               commit_graphs=c.commit_graphs,
                                               draft_ahead=c.draft_ahead,
                                               verify_ahead=c.verify_ahead)),
                self.eos, draft=self.draft if block else None, block_size=block)
            if torch.device(c.device).type == "cuda":
                engine.warmup()
            self._made[block] = engine
        return self._made[block]


def _params(config: TauConfig, temperature: float, i: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_new_tokens=config.max_new_tokens,
                          seed=None if temperature == 0 else config.seed * 100_003 + i)


def run_tau(config: TauConfig, *, progress: bool = True) -> TauReport:
    from common.model.dflash import load_draft
    from common.model.load import eos_token_ids_for, load_model
    from common.model.kernels import select_kernels
    from common.tokenizer import load_tokenizer
    from common.training.token_data import held_out_windows

    kernels = config.kernels
    if kernels == "auto":
        kernels = "gpu" if torch.device(config.device).type == "cuda" else "reference"
    dtype = getattr(torch, config.dtype) if config.dtype else None
    target = load_model(config.model, dtype=dtype, device=config.device,
                        kernels=select_kernels(kernels))
    draft = load_draft(config.draft, target)
    eos = eos_token_ids_for(config.model, target.config)
    tokenizer = load_tokenizer(config.model, allow_missing=True)
    prompts = held_out_windows(config.data, tokenizer if tokenizer.vocab_size else None,
                               eos[0] if eos else None, config.prompt_tokens,
                               config.num_prompts)
    engines = _Engines(config, target, draft, eos)
    report = TauReport(config)
    greedy_plain = None
    for block in config.blocks:
        for temperature in config.temperatures:
            params = [_params(config, temperature, i) for i in range(len(prompts))]
            reqs = engines.get(block).generate(prompts, params)
            lengths = [n for r in reqs for n in r.accept_lengths]
            row = TauRow(block, temperature, sum(lengths) / max(1, len(lengths)),
                         len(lengths), sum(len(r.output_ids) for r in reqs))
            if temperature == 0:
                if greedy_plain is None:
                    greedy_plain = [r.output_ids for r in engines.get(None).generate(
                        prompts, params)]
                row.identical = sum(r.output_ids == p for r, p in zip(reqs, greedy_plain)) \
                    / len(reqs)
            report.rows.append(row)
            if progress:
                print(f"  block {block:>2} temperature {temperature:g}: tau {row.tau:.2f}",
                      file=sys.stderr, flush=True)
    for batch in config.speed_batches:
        report.speed.append(_speed(config, engines, prompts, batch))
    return report


def _speed(config: TauConfig, engines: _Engines, prompts, batch: int) -> SpeedRow:
    """Tokens/s each way at ``batch`` requests at a time. The prompts run in as many whole
    batches of ``batch`` as they fill (fewer prompts than that: one batch, cycling them), so a
    small batch's rate and τ are not those of the first prompt alone: at batch 1 one prompt
    gave τ 9.96 where the mean over 32 was 4.26 (H100, 2026-12-06)."""
    if batch >= len(prompts):
        batches = [[prompts[i % len(prompts)] for i in range(batch)]]
    else:
        batches = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens,
                            ignore_eos=True)
    on_gpu = torch.device(config.device).type == "cuda"
    block = max(config.blocks)
    rates, decode_rates, tau, steps = {}, {}, 0.0, (0.0, 0.0)
    for which in (None, block):
        engine = engines.get(which)
        engine.generate(batches[0], replace(params, max_new_tokens=2))  # warm: first-call costs
        runs = [timed_generate(engine, chosen, params, on_gpu) for chosen in batches]
        tokens = sum(len(r.output_ids) for run in runs for r in run.requests)
        rates[which] = tokens / sum(run.seconds for run in runs)
        decode_seconds = sum(run.decode_seconds for run in runs)
        decode_rates[which] = (sum(run.decode_tokens for run in runs) / decode_seconds
                               if decode_seconds > 0 else 0.0)
        if which is not None:
            lengths = [n for run in runs for r in run.requests for n in r.accept_lengths]
            tau = sum(lengths) / max(1, len(lengths))
            requests = sum(len(run.requests) for run in runs)
            steps = (sum(run.decode_steps for run in runs) / len(runs), len(lengths) / requests)
    return SpeedRow(batch, block, rates[None], rates[block], tau,
                    decode_rates[None], decode_rates[block], *steps)


def format_table(report: TauReport) -> str:
    lines = [f"{'block':>5}  {'temp':>5}  {'tau':>6}  {'steps':>7}  {'tokens':>7}  "
             f"{'identical':>9}"]
    for r in report.rows:
        same = "-" if r.identical is None else f"{100 * r.identical:.0f}%"
        lines.append(f"{r.block_size:>5}  {r.temperature:>5g}  {r.tau:>6.2f}  {r.steps:>7}  "
                     f"{r.tokens:>7}  {same:>9}")
    if report.speed:
        lines += ["", f"{'batch':>5}  {'block':>5}  {'plain tok/s':>11}  {'dflash tok/s':>12}  "
                      f"{'speedup':>7}  {'decode x':>8}  {'tau':>5}  {'steps batch/row':>15}"]
        for s in report.speed:
            steps = f"{s.dflash_batch_steps:.0f}/{s.dflash_row_steps:.0f}"
            lines.append(f"{s.batch:>5}  {s.block_size:>5}  {s.plain_tokens_per_s:>11.1f}  "
                         f"{s.dflash_tokens_per_s:>12.1f}  {s.speedup:>6.2f}x  "
                         f"{s.decode_speedup:>7.2f}x  {s.tau:>5.2f}  {steps:>15}")
    return "\n".join(lines)


def as_json(report: TauReport) -> dict:
    return {"config": asdict(report.config), "tau": [asdict(r) for r in report.rows],
            "speed": [{**asdict(s), "speedup": s.speedup, "decode_speedup": s.decode_speedup}
                      for s in report.speed]}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dflash_tau",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target directory or built-in name")
    p.add_argument("--draft", required=True, help="draft directory or built-in name")
    p.add_argument("--data", required=True, help="held-out data (e.g. CORPUS/eval.jsonl)")
    p.add_argument("--blocks", default="8,16")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--num-prompts", type=int, default=TauConfig.num_prompts)
    p.add_argument("--prompt-tokens", type=int, default=TauConfig.prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, default=TauConfig.max_new_tokens)
    p.add_argument("--speed-batches", default="", help="e.g. 1,8,32 (default: no speed run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--seed", type=int, default=TauConfig.seed)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--json", default=None, metavar="PATH")
    add_dflash_step_flags(p)
    args = p.parse_args(argv)
    config = TauConfig(
        model=args.model, draft=args.draft, data=args.data,
        blocks=tuple(int(b) for b in _floats(args.blocks)),
        temperatures=_floats(args.temperatures), num_prompts=args.num_prompts,
        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
        speed_batches=tuple(int(b) for b in _floats(args.speed_batches)),
        device=args.device, kernels=args.kernels, seed=args.seed, dtype=args.dtype,
        commit_graphs=args.commit_graphs, draft_ahead=args.draft_ahead,
        verify_ahead=args.verify_ahead)
    report = run_tau(config)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(as_json(report), indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
