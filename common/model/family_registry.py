"""Model families by ``model_type``: which family parses a ``config.json``, builds its wrapper and
names its weights. (Built-in checkpoints by name are ``common/model/registry.py``.)

Adding a family is one module under ``common/model/families/`` that defines ``FAMILY`` (a
:class:`~common.model.families.family.ModelFamily`, plain data), its name in ``FAMILY_MODULES``,
and the module of its model code that ``FAMILY.model_module`` names. Parsing a config imports no
model code (and no torch): the router does it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import ConfigError, ModelConfig
from common.model.families.family import ModelFamily

if TYPE_CHECKING:
    from common.model.qwen3_5 import HybridForCausalLM

FAMILY_MODULES = (
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
)


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in ``FAMILY_MODULES`` order (modules are imported on first use)."""
    return tuple(importlib.import_module(f"common.model.families.{name}").FAMILY
                 for name in FAMILY_MODULES)


def known_model_types() -> list[str]:
    """Every ``model_type`` some family parses, sorted."""
    return sorted(t for family in families() for t in family.model_types)


def family_for(model_type: str | None) -> ModelFamily:
    """The family that parses ``model_type`` (a text or a wrapper type); ConfigError if none."""
    for family in families():
        if model_type in family.model_types:
            return family
    raise ConfigError(f"model_type {model_type!r} is not supported; known model types: "
                      f"{known_model_types()}")


def parse_model_config(cfg: dict) -> ModelConfig:
    """Parse a ``config.json`` dict (flat text config or a wrapper with ``text_config``)."""
    return family_for(cfg.get("model_type")).parse(cfg)


def read_model_config(path: str | Path) -> ModelConfig:
    """Read and parse ``config.json`` from a checkpoint directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"no config.json in {path}")
    return parse_model_config(json.loads(file.read_text()))


def model_class_for(config: ModelConfig) -> type[HybridForCausalLM]:
    """The wrapper class of ``config``'s family."""
    return family_for(config.model_type).wrapper
