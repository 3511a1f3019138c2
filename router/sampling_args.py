"""The sampling flags of ``flashsplit generate`` (in process or through a router), and how
their results print: one set of flags for both paths, so a flag cannot mean one thing in
process and another through the router."""

from __future__ import annotations

import argparse

from common.sampling import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="most tokens to generate, the first included")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="keep the most likely tokens up to this total probability (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this times the most likely one's probability "
                        "(0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the request's random stream (default: a random one)")
    p.add_argument("--stop-token-ids", type=str, default="",
                   help="comma-separated ids that end generation")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each token's log-probability and those of the N most likely "
                        "tokens at its position (0 to 20; printed with --json)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens,
        stop_token_ids=tuple(parse_ids(args.stop_token_ids)), ignore_eos=args.ignore_eos,
        logprobs=args.logprobs, speculative=speculative_choice(args))


def logprobs_json(params: SamplingParams, logprobs) -> dict:
    """``{"logprobs": [{"logprob", "top": [[id, logprob], ...]}, ...]}`` when asked for."""
    if params.logprobs is None:
        return {}
    return {"logprobs": [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                         for lp in logprobs]}


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"error: token ids must be comma-separated integers, got {text!r}")


def speculative_choice(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "on": True, "off": False}[args.speculative]
