"""Train the built-in target model: a small Qwen3.5-architecture model (Gated DeltaNet layers and
gated full attention, ``model_type: qwen3_5_text``) on the standard-library corpus.

The model is transformers' ``Qwen3_5ForCausalLM`` (the project's model code has no backward:
its kernels are inference kernels), trained with plain torch: AdamW, a cosine schedule over the
budget, next-token cross-entropy on random windows of the token stream, bf16 autocast on CUDA.
On CUDA transformers runs the GDN layers through fla's chunked kernels (forward and backward)
when fla-core is installed (the ``gpu`` extra), else through its plain-torch recurrence (slow).
The result is saved like any Hugging Face checkpoint and served by the project's own model.

Needs the ``train`` extra (transformers):

    python -m common.training.train_target --corpus CORPUS_DIR --tokenizer TOKENIZER_DIR --out DIR \
        [--seconds 330] [--steps N] [--device cuda]

``DIR`` gets config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
provenance.json and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from common.training.corpus import read_manifest
from common.training.curves import plot_curves, smooth
from common.training.provenance import PROVENANCE_FILE, environment, write_json
from common.training.schedule import BudgetBar, Budget, Clock, CosineSchedule
from common.training.token_data import WindowSampler, read_documents, spaced_windows, token_stream
from common.training.transformers_import import import_modeling_without_fla

# The shipped pycoder's shape: 8 layers (6 GDN + 2 gated attention), hidden 384, 128-dim heads as
# in the released models (the GPU kernels' fast paths): 19.9M parameters with an 8192-token
# vocabulary, 40 MB in bf16, small enough to ship in the repository beside its draft and to
# answer interactively on a CPU. benchmarks/small_target_arch.json is the earlier 7.2M shape
# (docs/training.md, "The built-in pair rebuilt on the full library").
PYCODER_ARCH = {
    "hidden_size": 384,
    "intermediate_size": 1152,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class TargetTrainConfig:
    """Args:
        corpus: a ``training.corpus`` directory (train.jsonl, eval.jsonl, manifest.json).
        tokenizer: directory of ``tokenizer.json`` (``training.bpe``).
        out: where the checkpoint goes.
        arch: transformers ``Qwen3_5TextConfig`` fields (the vocabulary comes from the
            tokenizer).
        eval_points: held-out evaluations spread over the run (the last at its end).
        save_dtype: dtype of the saved weights.
    """

    corpus: str
    tokenizer: str
    out: str
    budget: Budget
    arch: dict = field(default_factory=lambda: json.loads(json.dumps(PYCODER_ARCH)))
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup: float = 0.03
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 64
    eval_points: int = 8
    device: str = "cuda"
    seed: int = 0
    save_dtype: str = "bfloat16"
    # save the weights of the held-out evaluation with the lowest loss rather than the last
    # step's: a corpus of a few million tokens is memorised within a short budget (the 279M
    # target's held-out loss was lowest at half of its 420 s run and rose after), and an
    # over-fitted target's continuations of unseen text are what its draft must predict
    keep_best: bool = True
    progress: bool = True


def fla_backward_usable() -> bool:
    """Whether fla's GDN backward runs here: fla refuses it on Hopper with Triton older than
    3.7.1 (wrong gradients, fla issue 640) unless tilelang is installed."""
    import importlib.util

    if importlib.util.find_spec("fla") is None or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9 or importlib.util.find_spec("tilelang"):
        return True
    import triton

    version = tuple(int(x) for x in triton.__version__.split(".")[:3] if x.isdigit())
    return version >= (3, 7, 1)


def import_transformers(device: str):
    """transformers' Qwen3.5 classes. fla is kept unimportable first off CUDA (transformers
    would route the GDN layers to its Triton kernels, which need a GPU) and where its backward
    is refused (``fla_backward_usable``): transformers then trains the GDN layers with its
    plain-torch chunked recurrence. fla stays importable for the rest of the process."""
    if not str(device).startswith("cuda") or not fla_backward_usable():
        import_modeling_without_fla()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5TextConfig, Qwen3_5ForCausalLM


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (embedding included); none on norms, gates and biases."""
    decay, keep = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, *, batch_size: int, device: str) -> float:
    """Next-token cross-entropy (nats/token) of ``windows`` [n, T+1]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size].to(device)
        with _autocast(device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / max(1, count)


def _autocast(device: str):
    on_cuda = str(device).startswith("cuda")
    return torch.autocast("cuda" if on_cuda else "cpu", dtype=torch.bfloat16, enabled=on_cuda)


def train_target(config: TargetTrainConfig) -> dict:
    """Train, evaluate and save; returns the provenance written beside the weights."""
    from common.tokenizer import HFTokenizer

    torch.manual_seed(config.seed)
    if str(config.device).startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = HFTokenizer(config.tokenizer)
    if not tokenizer.eos_token_ids:
        raise ValueError(f"tokenizer {config.tokenizer} names no end-of-text token "
                         "(tokenizer_config.json eos_token)")
    eos = tokenizer.eos_token_ids[0]
    corpus = Path(config.corpus)
    train_stream = token_stream(read_documents(corpus / "train.jsonl"), tokenizer, separator=eos)
    eval_stream = token_stream(read_documents(corpus / "eval.jsonl"), tokenizer, separator=eos)

    config_cls, model_cls = import_transformers(config.device)
    hf_config = config_cls(**config.arch, vocab_size=tokenizer.vocab_size, eos_token_id=eos,
                           pad_token_id=eos, bos_token_id=None)
    model = model_cls(hf_config).to(config.device).train()
    num_params = sum(p.numel() for p in model.parameters())
    fused = str(config.device).startswith("cuda")
    opt = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=fused)
    schedule = CosineSchedule(config.lr, config.warmup, config.min_lr_ratio)
    sampler = WindowSampler(train_stream, config.seq_len + 1, config.seed)
    eval_set = spaced_windows(eval_stream, config.seq_len + 1, config.eval_windows)

    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    best = _BestWeights(enabled=config.keep_best)
    next_eval = 1.0 / config.eval_points
    clock, step = Clock(), 0
    bar = BudgetBar("train target", enabled=config.progress)
    while not config.budget.done(step, clock.elapsed()):
        fraction = config.budget.fraction(step, clock.elapsed())
        for group in opt.param_groups:
            group["lr"] = schedule.lr(fraction)
        x = sampler.sample(config.batch_size).to(config.device, non_blocking=True)
        with _autocast(config.device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append(float(loss.detach()))
        fraction = config.budget.fraction(step, clock.elapsed())
        if fraction >= next_eval and fraction < 1.0:
            evals.append((step, mean_loss(model, eval_set, batch_size=config.batch_size,
                                          device=config.device)))
            best.offer(model, *evals[-1])
            next_eval += 1.0 / config.eval_points
        bar.update(fraction, step=step, loss=f"{smooth(losses, 20)[-1]:.3f}",
                   eval=f"{evals[-1][1]:.3f}" if evals else "-")
    seconds = clock.elapsed()
    evals.append((step, mean_loss(model, eval_set, batch_size=config.batch_size,
                                  device=config.device)))
    best.offer(model, *evals[-1])
    bar.close()
    kept = best.restore(model)
    return _save(config, model, tokenizer_dir=Path(config.tokenizer), losses=losses,
                 evals=evals, kept=kept, seconds=seconds, num_params=num_params,
                 tokens=step * config.batch_size * config.seq_len,
                 stream_sizes=(train_stream.numel(), eval_stream.numel()))


class _BestWeights:
    """A CPU copy of the weights at the lowest held-out loss seen so far (``keep_best``)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.step, self.loss, self._state = None, float("inf"), None

    def offer(self, model: torch.nn.Module, step: int, loss: float) -> None:
        if self.enabled and loss < self.loss:
            self.step, self.loss = step, loss
            self._state = {k: v.detach().to("cpu", copy=True)
                           for k, v in model.state_dict().items()}

    def restore(self, model: torch.nn.Module) -> dict:
        """Load the kept weights into ``model``; says which evaluation's they are."""
        if self._state is not None:
            model.load_state_dict(self._state)
        return {"step": self.step, "eval_loss": round(self.loss, 4)} if self.enabled else {}


def _save(config: TargetTrainConfig, model, *, tokenizer_dir: Path, losses, evals, kept: dict,
          seconds, num_params, tokens, stream_sizes) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, config.save_dtype)).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    smoothed = smooth(losses, 20)
    plot_curves(out / "loss.png", title=f"target: {num_params / 1e6:.1f}M parameters, "
                f"{tokens / 1e6:.0f}M tokens, {seconds:.0f} s"
                + (f", weights of step {kept['step']}" if kept else ""),
                series={"train (20-step mean)": (list(range(1, len(losses) + 1)), smoothed),
                        "held-out": ([s for s, _ in evals], [v for _, v in evals])})
    every = max(1, len(losses) // 200)
    provenance = {
        "what": "flashsplit built-in target model",
        "architecture": {"model_type": "qwen3_5_text", **config.arch,
                         "vocab_size": model.config.vocab_size},
        "parameters": num_params,
        "corpus": read_manifest(config.corpus),
        "tokenizer": json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        if (tokenizer_dir / "tokenizer_config.json").is_file() else None,
        "training": {
            **{k: v for k, v in dataclasses.asdict(config).items() if k != "arch"},
            "objective": "next-token cross-entropy, AdamW (0.9, 0.95), cosine over the budget",
            "steps": len(losses), "tokens": tokens, "seconds": round(seconds, 1),
            "train_stream_tokens": stream_sizes[0], "eval_stream_tokens": stream_sizes[1],
            "final_train_loss": round(smoothed[-1], 4) if smoothed else None,
            "eval_loss": [{"step": s, "loss": round(v, 4)} for s, v in evals],
            # the saved weights: those of this evaluation (keep_best), else the last step's
            "saved_weights": kept or {"step": len(losses), "eval_loss": round(evals[-1][1], 4)},
            "train_loss_every_n_steps": {"n": every, "loss": [round(v, 4)
                                                              for v in smoothed[::every]]},
        },
        "environment": environment(config.device),
    }
    write_json(out / PROVENANCE_FILE, provenance)
    return provenance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.training.train_target",
                                description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True, help="directory of tokenizer.json")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=None, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (budget)")
    p.add_argument("--batch-size", type=int, default=TargetTrainConfig.batch_size)
    p.add_argument("--seq-len", type=int, default=TargetTrainConfig.seq_len)
    p.add_argument("--lr", type=float, default=TargetTrainConfig.lr)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=TargetTrainConfig.seed)
    p.add_argument("--save-dtype", default=TargetTrainConfig.save_dtype,
                   help="dtype of the saved weights")
    p.add_argument("--arch", default=None,
                   help="JSON file of Qwen3_5TextConfig fields replacing the built-in model's")
    p.add_argument("--keep-last", action="store_true",
                   help="save the last step's weights, not those of the held-out evaluation "
                        "with the lowest loss")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.seconds is None and args.steps is None:
        p.error("give --seconds, --steps or both")
    arch = json.loads(Path(args.arch).read_text()) if args.arch else PYCODER_ARCH
    config = TargetTrainConfig(
        corpus=args.corpus, tokenizer=args.tokenizer, out=args.out,
        budget=Budget(max_steps=args.steps, max_seconds=args.seconds), arch=dict(arch),
        seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, device=args.device,
        seed=args.seed, save_dtype=args.save_dtype, keep_best=not args.keep_last,
        progress=not args.no_progress)
    result = train_target(config)
    t = result["training"]
    kept = t["saved_weights"]
    print(f"target: {result['parameters'] / 1e6:.1f}M parameters, {t['steps']} steps, "
          f"{t['tokens'] / 1e6:.1f}M tokens in {t['seconds']} s, held-out loss "
          f"{t['eval_loss'][-1]['loss']}; saved the weights of step {kept['step']} (held-out "
          f"loss {kept['eval_loss']}) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
