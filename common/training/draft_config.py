"""What a draft training run is asked for: the draft's shape (:class:`DraftArch`) and the run's
settings (:class:`DraftTrainConfig`). Plain data without torch, so that ``flashsplit`` builds
its ``train-draft`` flags from these defaults without loading it."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.training.schedule import Budget

__all__ = ["DraftArch", "DraftTrainConfig"]


@dataclass(frozen=True)
class DraftArch:
    """The draft's shape; None fields follow the target.

    Args:
        num_layers: draft decoder layers.
        block_size: B, the block it is trained for (it also serves smaller blocks).
        target_layer_ids: captured target layers (default: z-lab's rule for ``num_layers``,
            without repeats).
        mask_token_id: default: the tokenizer's mask token, else the first id of the model's
            vocabulary past the tokenizer's (an embedding row no text uses).
        num_heads / num_kv_heads: default: the target's attention head counts.
        head_dim: 128 by default, as in z-lab's drafts.
        intermediate_size: default: the target's (3 x hidden for a MoE target).
        rope_theta: default: the target's.
    """

    num_layers: int = 2
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int = 128
    intermediate_size: int | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"a draft needs at least one layer, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")


@dataclass(frozen=True)
class DraftTrainConfig:
    """Args:
        target: checkpoint directory or built-in name of the target.
        data: training data (``common.training.token_data``).
        out: output directory.
        seq_len: tokens per window; anchors lie in ``1 .. seq_len - block_size``.
        batch_size: windows per step; num_anchors: blocks per window.
        dtype: of the saved weights (default: the target's).
        target_dtype: the target's compute dtype (default: its config's).
        kernels: the target's kernel set ("auto": "gpu" on CUDA, else "reference").
        train_on_prompts: a regenerated line's prompt (corpus text, not the target's) is
            trained on too; by default only the tokens the target wrote are labels.
        eval_data: held-out data, evaluated ``eval_points`` times over the run
            (``common.training.draft_eval``: loss, accept length, and the τ a decode would
            see); default: ``eval_fraction`` of the data's documents, kept out of training
            (0: no evaluation).
        eval_windows: held-out windows of ``seq_len`` tokens an evaluation reads.
    """

    target: str
    data: str
    out: str
    budget: Budget
    arch: DraftArch = field(default_factory=DraftArch)
    seq_len: int = 512
    batch_size: int = 8
    num_anchors: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.03
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    loss_decay_gamma: float | None = 7.0
    checkpoint_every: int = 200
    device: str = "cpu"
    dtype: str | None = None
    target_dtype: str | None = None
    kernels: str = "auto"
    seed: int = 0
    train_on_prompts: bool = False
    eval_data: str | None = None
    eval_fraction: float = 0.02
    eval_windows: int = 16
    eval_points: int = 4
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.seq_len <= self.arch.block_size:
            raise ValueError(f"seq_len {self.seq_len} must exceed the block size "
                             f"{self.arch.block_size}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must lie in [0, 1), got {self.eval_fraction}")
        for name in ("batch_size", "num_anchors", "checkpoint_every", "eval_windows",
                     "eval_points"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
