"""The ``flashsplit train-draft`` subcommand: its flags and its entry point."""

from __future__ import annotations

import argparse
import sys

from common.cli_help import HelpFormatter
from common.training.draft_config import DraftArch, DraftTrainConfig


def add_train_draft_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train-draft", help="train a DFLASH draft (z-lab format) for a target checkpoint",
        description="Train a z-lab-format DFLASH draft for a target: the target's hidden "
                    "states at target_layer_ids feed the draft, which learns to fill blocks "
                    "[anchor, MASK x (B-1)] (docs/training.md). The result loads with --draft.",
        formatter_class=HelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint directory or built-in name")
    p.add_argument("--data", required=True,
                   help="training data: a .jsonl of {\"text\"} or {\"token_ids\"}, a corpus "
                        "directory (train.jsonl), a directory of text files, or a text file")
    p.add_argument("--out", required=True, help="output directory (draft, provenance, loss.png,"
                                                " checkpoint/)")
    arch = p.add_argument_group("draft architecture (defaults follow the target)")
    arch.add_argument("--block-size", type=int, default=DraftArch.block_size,
                      help="B, the block the draft is trained for (it serves smaller ones too)")
    arch.add_argument("--layers", type=int, default=DraftArch.num_layers,
                      help="draft decoder layers")
    arch.add_argument("--target-layer-ids", default=None,
                      help="comma-separated target layers to capture (default: z-lab's rule)")
    arch.add_argument("--mask-token-id", type=int, default=None,
                      help="default: the tokenizer's mask token, else the first id past the "
                           "tokenizer's vocabulary")
    arch.add_argument("--heads", type=int, default=None, help="default: the target's")
    arch.add_argument("--kv-heads", type=int, default=None, help="default: the target's")
    arch.add_argument("--head-dim", type=int, default=DraftArch.head_dim, help="per head")
    arch.add_argument("--intermediate-size", type=int, default=None,
                      help="MLP width (default: the target's; 3 x hidden for MoE targets)")
    run = p.add_argument_group("training")
    run.add_argument("--steps", type=int, default=None,
                     help="optimizer steps (default 1000 when --seconds is not given)")
    run.add_argument("--seconds", type=float, default=None, help="wall-clock budget")
    run.add_argument("--seq-len", type=int, default=DraftTrainConfig.seq_len,
                     help="tokens per training window")
    run.add_argument("--batch-size", type=int, default=DraftTrainConfig.batch_size,
                     help="windows per step")
    run.add_argument("--anchors", type=int, default=DraftTrainConfig.num_anchors,
                     help="blocks per window")
    run.add_argument("--lr", type=float, default=DraftTrainConfig.lr,
                     help="peak learning rate (AdamW, cosine over the budget)")
    run.add_argument("--loss-decay-gamma", type=float, default=DraftTrainConfig.loss_decay_gamma,
                     help="row k of a block weighs exp(-(k-1)/gamma); 0 = equal weights")
    run.add_argument("--train-on-prompts", action="store_true",
                     help="also learn the prompts of regenerated data (lines with "
                          "\"prompt_tokens\"), not only what the target wrote")
    ev = p.add_argument_group("held-out evaluation (loss, accept length, and the τ a decode "
                              "would see)")
    ev.add_argument("--eval-data", default=None,
                    help="held-out data in any --data form (default: --eval-fraction of "
                         "--data's documents, kept out of training)")
    ev.add_argument("--eval-fraction", type=float, default=DraftTrainConfig.eval_fraction,
                    help="share of the documents held out when --eval-data is not given "
                         "(every k-th, k = 1/fraction); 0: no evaluation")
    ev.add_argument("--eval-windows", type=int, default=DraftTrainConfig.eval_windows,
                    help="held-out windows of --seq-len tokens per evaluation")
    ev.add_argument("--eval-points", type=int, default=DraftTrainConfig.eval_points,
                    help="evaluations spread over the run, the last at its end")
    run.add_argument("--checkpoint-every", type=int, default=DraftTrainConfig.checkpoint_every,
                     help="steps between checkpoints")
    run.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    run.add_argument("--dtype", default=None, help="saved weights' dtype (default: the target's)")
    run.add_argument("--target-dtype", default=None, help="the target's compute dtype")
    run.add_argument("--kernels", default="auto", help="the target's kernel set")
    run.add_argument("--seed", type=int, default=DraftTrainConfig.seed,
                     help="initial weights, windows and anchors")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> DraftTrainConfig:
    from common.training.schedule import Budget

    try:
        ids = None if args.target_layer_ids is None else tuple(
            int(t) for t in args.target_layer_ids.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--target-layer-ids must be comma-separated integers, got "
                         f"{args.target_layer_ids!r}") from None
    steps = args.steps if args.steps is not None or args.seconds is not None else 1000
    arch = DraftArch(num_layers=args.layers, block_size=args.block_size, target_layer_ids=ids,
                     mask_token_id=args.mask_token_id, num_heads=args.heads,
                     num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                     intermediate_size=args.intermediate_size)
    return DraftTrainConfig(
        target=args.target, data=args.data, out=args.out,
        budget=Budget(max_steps=steps, max_seconds=args.seconds), arch=arch,
        seq_len=args.seq_len, batch_size=args.batch_size, num_anchors=args.anchors, lr=args.lr,
        loss_decay_gamma=args.loss_decay_gamma or None, checkpoint_every=args.checkpoint_every,
        device=args.device, dtype=args.dtype, target_dtype=args.target_dtype,
        kernels=args.kernels, seed=args.seed, train_on_prompts=args.train_on_prompts,
        eval_data=args.eval_data, eval_fraction=args.eval_fraction,
        eval_windows=args.eval_windows, eval_points=args.eval_points, resume=args.resume,
        progress=not args.no_progress)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from common.training.train_draft import train_draft

    result = train_draft(config_from_args(args))
    t = result["training"]
    print(f"draft: {result['parameters'] / 1e6:.2f}M parameters, {t['steps']} steps in "
          f"{t['seconds']} s, final loss {t['final']['loss']}, accept length on the data "
          f"{t['final']['accept_length_on_data']}{_held_out(result)}; written to {args.out}",
          file=sys.stderr)
    return 0


def _held_out(result: dict) -> str:
    evals = result.get("held_out", {}).get("evaluations")
    if not evals:
        return ""
    last = evals[-1]
    return (f"; held-out: loss {last['loss']}, accept length {last['accept_length']}, "
            f"decode τ {last['tau']}")
