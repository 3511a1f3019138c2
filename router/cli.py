"""The ``flashsplit`` command: ``generate`` (in-process) and ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from common.sampling import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=str, default="",
                   help="comma-separated ids that end generation")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens,
        stop_token_ids=tuple(parse_ids(args.stop_token_ids)), ignore_eos=args.ignore_eos)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"error: token ids must be comma-separated integers, got {text!r}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (built in)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the config's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashsplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt in this process")
    add_model_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=str)
    src.add_argument("--prompt-ids", type=str, help="comma-separated token ids")
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="generate a few prompts on the built-in model")
    add_model_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=24)
    return parser


def run_local(args: argparse.Namespace, prompts: list[list[int]],
              params: SamplingParams) -> tuple[list, float, object]:
    """Load the model, run ``prompts`` to completion; return requests, seconds, tokenizer."""
    import torch

    from common.engine.llm_engine import EngineConfig, LLMEngine
    from common.model.load import load_model
    from common.tokenizer import load_tokenizer

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype=dtype, device=args.device)
    tokenizer = load_tokenizer(args.model)
    engine = LLMEngine(model, EngineConfig(device=args.device),
                       eos_token_ids=tokenizer.eos_token_ids)
    start = time.perf_counter()
    reqs = engine.generate(prompts, params)
    return reqs, time.perf_counter() - start, tokenizer


def cmd_generate(args: argparse.Namespace) -> int:
    from common.tokenizer import load_tokenizer

    params = sampling_from_args(args)
    tokenizer = load_tokenizer(args.model)
    prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None \
        else tokenizer.encode(args.prompt)
    (req,), seconds, tokenizer = run_local(args, [prompt], params)
    text = tokenizer.decode(req.output_ids)
    if args.json:
        print(json.dumps({"token_ids": req.output_ids, "text": text,
                          "prompt_tokens": len(prompt), "finish_reason": req.finish_reason,
                          "seconds": round(seconds, 6)}))
    else:
        print(text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    texts = ["Hello, flashsplit!", "The quick brown fox", "Gated DeltaNet keeps a state of"]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    reqs, seconds, tokenizer = run_local(args, [tokenizer.encode(t) for t in texts], params)
    for text, req in zip(texts, reqs):
        print(f"prompt: {text!r}\n  -> {tokenizer.decode(req.output_ids)!r} "
              f"({len(req.output_ids)} tokens, {req.finish_reason})")
    total = sum(len(r.output_ids) for r in reqs)
    print(f"{len(reqs)} requests, {total} tokens in {seconds:.3f} s "
          f"({total / seconds:.1f} tokens/s, in process on {args.device})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"generate": cmd_generate, "demo": cmd_demo}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
