"""Built-in checkpoint names: what ``--model`` and ``--draft`` accept besides a directory.

``tiny`` (``common/model/builtin.py``) is random and built in code. The names here are trained
checkpoints that ship in the repository, ``common/model/weights/<name>/`` (the target: config,
safetensors, ``tokenizer.json``, ``provenance.json``) and ``common/model/weights/<name>-dflash/``
(its DFLASH draft); ``--model <name>`` and ``--draft <name>`` resolve to those directories and
then load like any checkpoint. How the weights are rebuilt: docs/training.md.

Nothing here imports torch: the CLI reads the default model name before any model loads, and
the router reads a model's config (:func:`load_config`) without loading the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import ModelConfig
from common.model.builtin import TINY_NAME, tiny_config
from common.model.family_registry import read_model_config

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
TINY = "tiny"
REBUILD_COMMAND = "bash benchmarks/train_builtin_gpu.sh OUT_DIR"


@dataclass(frozen=True)
class BuiltinCheckpoint:
    """A trained built-in model and its draft, by name."""

    name: str
    description: str
    # what `flashsplit demo` sends this model (it is a code model: prompts are code)
    demo_prompts: tuple[str, ...]

    @property
    def target_dir(self) -> Path:
        return WEIGHTS_DIR / self.name

    @property
    def draft_dir(self) -> Path:
        return WEIGHTS_DIR / f"{self.name}-dflash"


PYCODER = BuiltinCheckpoint(
    name="pycoder",
    description="a small Qwen3.5-architecture model trained on the Python standard library",
    # prompts that end inside a line: the tokenizer merges a newline with the indentation after
    # it, so a prompt ending in a bare newline starts the model off a token it rarely saw
    demo_prompts=(
        "def read_lines(path):\n    with open(path",
        'import os\n\n\ndef list_files(path):\n    """',
        "class Stack:\n    def __init__(self):\n        self.",
        "def fibonacci(n):\n    if n",
    ),
)

BUILTIN_CHECKPOINTS: dict[str, BuiltinCheckpoint] = {c.name: c for c in (PYCODER,)}

# The model `flashsplit demo` / `generate` / `up` use when --model is not given (and so
# `make demo`); the tests name `tiny` (random, built in code) where they need a model.
DEFAULT_MODEL = PYCODER.name


def resolve_model(name_or_path: str) -> str:
    """The directory of a built-in checkpoint for its name; anything else is returned as is.

    A built-in name whose weights are not in the tree is a FileNotFoundError that says how to
    build them.
    """
    checkpoint = BUILTIN_CHECKPOINTS.get(name_or_path)
    if checkpoint is None:
        return name_or_path
    return str(_present(checkpoint.target_dir, f"built-in model {name_or_path!r}"))


def load_config(name_or_path: str) -> ModelConfig:
    """The config of ``tiny``, a built-in checkpoint by name, or a checkpoint directory."""
    if name_or_path == TINY_NAME:
        return tiny_config()
    return read_model_config(resolve_model(name_or_path))


def resolve_draft(name_or_path: str) -> str:
    """The directory of a built-in checkpoint's draft for its name; anything else as is."""
    checkpoint = BUILTIN_CHECKPOINTS.get(name_or_path)
    if checkpoint is None:
        return name_or_path
    return str(_present(checkpoint.draft_dir, f"the draft of built-in model {name_or_path!r}"))


def demo_prompts_for(name_or_path: str) -> tuple[str, ...] | None:
    """The demo prompts of a built-in checkpoint, None for any other model."""
    checkpoint = BUILTIN_CHECKPOINTS.get(name_or_path)
    return None if checkpoint is None else checkpoint.demo_prompts


def _present(directory: Path, what: str) -> Path:
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} has no weights in {directory}: build them on a GPU with "
            f"`{REBUILD_COMMAND}` and copy them there (docs/training.md)")
    return directory
