"""``flashsplit train-draft``: train a z-lab-format DFLASH draft for any supported target.

Per step: random windows of the data are run through the target (the project's own model, on
the serving kernels) with capture on at the draft's ``target_layer_ids``; random anchors of
each window become blocks ``[anchor token, MASK x (B-1)]``; the draft's block-diffusion loss
(``common.training.draft_forward``) is minimised with AdamW on a cosine schedule over the
budget (steps, seconds, or both). The target is never updated.

``OUT`` receives the draft (``config.json``, ``model.safetensors``), ``provenance.json`` and
``loss.png``. Held-out data (``eval_data``, else a share of the data's documents) is evaluated
``eval_points`` times (``common.training.draft_eval``): the loss, the accept length, and the τ
a decode would see, which the accept length on training batches overstates about twofold.
``OUT/checkpoint/`` holds the training state (draft, optimizer, data and anchor
generators, history), written every ``checkpoint_every`` steps and at the end, from which
``resume`` continues the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from common.model.dflash import DFlashDraftModel
from common.model.dflash_config import DFlashConfig
from common.training.capture import HiddenCapture
from common.training.curves import plot_curves, smooth
from common.training.draft_eval import DraftEval, HeldOutSet, split_held_out
from common.training.draft_forward import block_loss, sample_anchors
from common.training.draft_config import DraftTrainConfig
from common.training.draft_setup import (draft_config_dict, init_draft_weights,
                                         resolve_mask_token_id, save_draft)
from common.training.provenance import PROVENANCE_FILE, environment, write_json
from common.training.regenerate import read_provenance
from common.training.schedule import BudgetBar, Clock, CosineSchedule
from common.training.token_data import WindowSampler, read_documents, token_stream_and_labels

STATE_FILE = "training_state.pt"
# settings a resumed run must share with the run it continues (the budget may change)
_RUN_FIELDS = ("target", "data", "arch", "seq_len", "batch_size", "num_anchors", "lr",
               "weight_decay", "warmup", "min_lr_ratio", "grad_clip", "loss_decay_gamma",
               "seed", "target_dtype", "train_on_prompts", "eval_data", "eval_fraction")


def checkpoint_path(out: str | Path) -> Path:
    """Where a run writing to ``out`` keeps its training state."""
    return Path(out) / "checkpoint" / STATE_FILE


def _run_settings(config: DraftTrainConfig) -> dict:
    settings = dataclasses.asdict(config)
    return json.loads(json.dumps({k: settings[k] for k in _RUN_FIELDS}))


def _same_place(name: str) -> str:
    """``target`` or ``data`` as a resumed run compares it: an existing path, absolute (so
    ``out/t`` and ``/home/me/out/t`` match), else as given (a built-in name)."""
    path = Path(name)
    return str(path.resolve()) if path.exists() else name


def _changed_settings(saved: dict, now: dict) -> list[str]:
    def norm(settings: dict) -> dict:
        return {**settings, **{k: _same_place(settings[k]) for k in ("target", "data")
                               if isinstance(settings.get(k), str)}}
    saved, now = norm(saved), norm(now)
    return sorted(k for k in saved if saved[k] != now.get(k))


class _Run:
    """Everything one training run holds; built fresh or from a checkpoint."""

    def __init__(self, config: DraftTrainConfig) -> None:
        from common.model.load import eos_token_ids_for, load_model
        from common.model.kernels import select_kernels
        from common.tokenizer import load_tokenizer

        self.config = config
        self.device = torch.device(config.device)
        kernels = config.kernels
        if kernels == "auto":
            kernels = "gpu" if self.device.type == "cuda" else "reference"
        target_dtype = getattr(torch, config.target_dtype) if config.target_dtype else None
        self.target = load_model(config.target, dtype=target_dtype, device=self.device,
                                 kernels=select_kernels(kernels))
        tokenizer = load_tokenizer(config.target, allow_missing=True)
        tokenizer = tokenizer if tokenizer.vocab_size else None
        eos = eos_token_ids_for(config.target, self.target.config)
        separator, vocab = (eos[0] if eos else None), self.target.config.vocab_size
        documents = read_documents(config.data)
        if config.eval_data:
            held, self.held_out_source = read_documents(config.eval_data), config.eval_data
        else:
            documents, held = split_held_out(documents, config.eval_fraction)
            self.held_out_source = (f"every {round(1 / config.eval_fraction)}th document of the "
                                    f"data" if held else None)
            if not held and config.eval_fraction:
                print(f"train-draft: no held-out evaluation: the data has {len(documents)} "
                      f"documents, too few to hold out {config.eval_fraction:g} of them "
                      f"(give --eval-data)", file=sys.stderr)
        stream, labels = token_stream_and_labels(documents, tokenizer, separator=separator,
                                                 vocab_size=vocab)
        self.held_out = self.held_out_documents = None
        if held:
            held_stream, held_labels = token_stream_and_labels(held, tokenizer,
                                                               separator=separator,
                                                               vocab_size=vocab)
            if held_stream.numel() < config.seq_len:
                raise ValueError(f"the held-out data has {held_stream.numel()} tokens, fewer "
                                 f"than one window of --seq-len {config.seq_len}")
            self.held_out = HeldOutSet(held_stream, held_labels, config.seq_len,
                                       config.eval_windows)
            self.held_out_documents = len(held)
        if config.train_on_prompts:
            labels = torch.ones_like(labels)
        self.stream_tokens, self.label_tokens = int(stream.numel()), int(labels.sum())
        self.sampler = WindowSampler(stream, config.seq_len, config.seed, labels=labels)
        self.anchor_gen = torch.Generator().manual_seed(config.seed + 1)
        self.save_dtype = config.dtype or str(self.target.dtype).replace("torch.", "")
        mask = resolve_mask_token_id(config.arch.mask_token_id, tokenizer, self.target.config)
        self.draft_config = draft_config_dict(self.target.config, config.arch,
                                              mask_token_id=mask, dtype=self.save_dtype)
        with torch.device(self.device):
            self.draft = DFlashDraftModel(
                DFlashConfig.from_dict(self.draft_config, target=self.target.config),
                dtype=torch.float32, kernels=self.target.kernels)
        init_draft_weights(self.draft, config.seed)
        self.draft.train().requires_grad_(True)
        self.capture = HiddenCapture(self.target, self.draft.config.target_layer_ids,
                                     max_sequences=config.batch_size, seq_len=config.seq_len,
                                     device=self.device)
        self.autocast = self.device.type == "cuda"
        embed = self.target.get_input_embeddings().weight
        head = self.target.get_output_weight()
        # off CUDA there is no autocast: the draft's fp32 math needs fp32 copies
        self.embed = embed if self.autocast else embed.float()
        self.lm_head = head if self.autocast else head.float()
        decay = [p for p in self.draft.parameters() if p.dim() >= 2]
        keep = [p for p in self.draft.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay},
             {"params": keep, "weight_decay": 0.0}],
            lr=config.lr, betas=(0.9, 0.95), fused=self.autocast)
        self.step, self.elapsed_s = 0, 0.0
        self.history: list[list[float]] = []  # [step, loss, accuracy, accept length]
        self.evals: list[DraftEval] = []

    # checkpoints
    @property
    def state_path(self) -> Path:
        return checkpoint_path(self.config.out)

    def save_checkpoint(self, elapsed_s: float) -> None:
        path = self.state_path
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "settings": json.dumps(_run_settings(self.config)),
            "draft_config": json.dumps(self.draft_config),
            "draft": self.draft.state_dict(), "optimizer": self.opt.state_dict(),
            "step": self.step, "elapsed_s": elapsed_s, "history": self.history,
            "evals": json.dumps([e.row() for e in self.evals]),
            "sampler": self.sampler.state(), "anchors": self.anchor_gen.get_state(),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # a run killed mid-write keeps the previous checkpoint

    def load_checkpoint(self) -> None:
        state = torch.load(self.state_path, map_location=self.device, weights_only=True)
        saved, now = json.loads(state["settings"]), _run_settings(self.config)
        changed = _changed_settings(saved, now)
        if changed:
            raise ValueError(f"--resume with settings that differ from the checkpoint's: "
                             f"{', '.join(f'{k} (was {saved[k]!r})' for k in changed)}")
        if json.loads(state["draft_config"]) != self.draft_config:
            raise ValueError("--resume: the checkpoint's draft config differs from this one's")
        self.draft.load_state_dict(state["draft"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.elapsed_s = int(state["step"]), float(state["elapsed_s"])
        self.history = [list(h) for h in state["history"]]
        self.evals = [DraftEval(**row) for row in json.loads(state.get("evals", "[]"))]
        self.sampler.load_state(state["sampler"].cpu())
        self.anchor_gen.set_state(state["anchors"].cpu())

    def evaluate(self) -> DraftEval | None:
        """The held-out evaluation at this step (None without held-out data)."""
        if self.held_out is None:
            return None
        result = self.held_out.evaluate(
            self.step, draft=self.draft, capture=self.capture, embed=self.embed,
            lm_head=self.lm_head, loss_decay_gamma=self.config.loss_decay_gamma,
            batch_size=self.config.batch_size, autocast=self.autocast)
        self.evals.append(result)
        return result

    # one optimizer step
    def train_step(self, lr: float) -> list[float]:
        c = self.config
        for group in self.opt.param_groups:
            group["lr"] = lr
        # on the CPU: the capture batch reads them
        windows, labels = self.sampler.sample_with_labels(c.batch_size)
        aux = self.capture(windows)
        tokens = windows.to(self.device)
        anchors = sample_anchors(c.batch_size, c.seq_len, c.arch.block_size, c.num_anchors,
                                 generator=self.anchor_gen, device=self.device, labels=labels)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = block_loss(self.draft, aux, tokens, anchors, embed=self.embed,
                             lm_head=self.lm_head, loss_decay_gamma=c.loss_decay_gamma,
                             labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), c.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        row = [self.step, float(out.loss.detach()), float(out.accuracy),
               float(out.accept_length)]
        self.history.append(row)
        return row


def train_draft(config: DraftTrainConfig) -> dict:
    """Train (or resume) and export; returns the provenance written beside the draft."""
    out, state = Path(config.out), checkpoint_path(config.out)
    if state.is_file() and not config.resume:
        raise ValueError(f"{out} already holds a training checkpoint ({state}): pass --resume "
                         "to continue it, or choose another --out")
    if config.resume and not state.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {state}")
    torch.manual_seed(config.seed)
    run = _Run(config)
    if config.resume:
        run.load_checkpoint()
    # the target's first forward compiles and autotunes its kernels (minutes on a fresh GPU
    # machine): outside the budget, which is for training
    run.capture(torch.zeros(1, config.seq_len, dtype=torch.long))
    clock = Clock(run.elapsed_s)
    schedule = CosineSchedule(config.lr, config.warmup, config.min_lr_ratio)
    fraction = config.budget.fraction(run.step, clock.elapsed())
    bar = BudgetBar("train draft", enabled=config.progress, initial=fraction)
    points = config.eval_points
    next_eval = (int(fraction * points) + 1) / points  # the first not yet passed
    try:
        while not config.budget.done(run.step, clock.elapsed()):
            _, loss, acc, accept = run.train_step(
                schedule.lr(config.budget.fraction(run.step, clock.elapsed())))
            fraction = config.budget.fraction(run.step, clock.elapsed())
            if next_eval <= fraction < 1.0:
                run.evaluate()
                next_eval = (int(fraction * points) + 1) / points
            if run.step % config.checkpoint_every == 0:
                run.save_checkpoint(clock.elapsed())
            held = f"{run.evals[-1].tau:.2f}" if run.evals else "-"
            bar.update(fraction, step=run.step, loss=f"{loss:.3f}", acc=f"{acc:.3f}",
                       accept=f"{accept:.2f}", held_out_tau=held)
    finally:
        bar.close()
    seconds = clock.elapsed()
    if not run.evals or run.evals[-1].step != run.step:
        run.evaluate()  # the end of the run
    run.save_checkpoint(seconds)
    save_draft(run.draft, run.draft_config, out, dtype=run.save_dtype)
    return _write_report(run, seconds)


def _write_report(run: _Run, seconds: float) -> dict:
    config, out = run.config, Path(run.config.out)
    steps = [h[0] for h in run.history]
    window = max(1, min(50, len(steps) // 10))
    series = {f"loss ({window}-step mean)": (steps, smooth([h[1] for h in run.history],
                                                            window))}
    if run.evals:
        series["held-out loss"] = ([e.step for e in run.evals], [e.loss for e in run.evals])
    plot_curves(out / "loss.png",
                title=f"DFLASH draft, B={config.arch.block_size}: {run.step} steps, "
                      f"{seconds:.0f} s", series=series)
    every = max(1, len(steps) // 200)
    last = run.history[-window:] if run.history else []
    provenance = {
        "what": "DFLASH draft (z-lab format) trained by flashsplit train-draft",
        "draft_config": run.draft_config,
        "parameters": sum(p.numel() for p in run.draft.parameters()),
        "target": config.target,
        "target_config": run.target.config.raw,
        "data": config.data,
        "data_tokens": run.stream_tokens,
        "label_tokens": run.label_tokens,
        "data_made_by": read_provenance(config.data),
        "held_out": {} if run.held_out is None else {
            "source": run.held_out_source, "documents": run.held_out_documents,
            "tokens": run.held_out.num_tokens, "windows": len(run.held_out.tokens),
            "evaluations": [e.row() for e in run.evals],
            "tau_means": "a greedy decode's tokens per step with the held-out tokens as the "
                         "verifier's choices (common/training/draft_eval.py)"},
        "training": {
            **json.loads(json.dumps(dataclasses.asdict(config))),
            "objective": "block diffusion: random anchors, blocks [anchor, MASK x (B-1)], "
                         "cross-entropy on the masked rows, decay exp(-(k-1)/gamma)"
                         + ("; anchors and rows on the target's own tokens only"
                            if run.label_tokens < run.stream_tokens else ""),
            "steps": run.step, "seconds": round(seconds, 1),
            "tokens_captured": run.step * config.batch_size * config.seq_len,
            "final": {"loss": _mean(last, 1), "accuracy": _mean(last, 2),
                      "accept_length_on_data": _mean(last, 3)},
            "history_every_n_steps": {"n": every, "rows": ["step", "loss", "accuracy",
                                                           "accept_length"],
                                      "values": [[round(v, 4) for v in h]
                                                 for h in run.history[::every]]},
        },
        "environment": environment(config.device),
    }
    write_json(out / PROVENANCE_FILE, provenance)
    return provenance


def _mean(rows: list[list[float]], column: int) -> float | None:
    return round(sum(r[column] for r in rows) / len(rows), 4) if rows else None
