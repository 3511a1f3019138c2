"""What a model family declares: its config defaults and fixed choices, its wrapper class and its
weight-name rules. One module per family under ``common/model/families/`` builds one
:class:`ModelFamily`; ``common/model/family_registry.py`` lists those modules.

A family module is plain data, without torch: the router parses configs with it. The family's
model code (its wrapper class and weight rules) is a module of its own, ``model_module``, imported
on first use of :attr:`ModelFamily.wrapper` or :attr:`ModelFamily.weight_rules`."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from common.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from common.model.qwen3_5 import HybridForCausalLM
    from common.model.weight_rules import WeightRule

# keys a wrapper config (vision-language ``config.json``) may keep at its top level only
_INHERITED_BY_TEXT = ("eos_token_id", "bos_token_id", "torch_dtype", "dtype")


@dataclass(frozen=True)
class ModelFamily:
    """One family of hybrid checkpoints.

    ``text_model_type``: the text config's ``model_type`` (``ModelConfig.model_type``).
    ``wrapper_model_type``: the ``model_type`` of a wrapper config that holds the text config
    under ``text_config`` (None when the family has no wrapper).
    ``defaults``: transformers' documented default per field, used only where a config omits it.
    ``fixed``: fields the family decides whatever the file says (its layer choices).
    ``model_module``: the module of the family's model code: ``WRAPPER``, the causal-LM class
    built for this family, and ``WEIGHT_RULES``, tried in order on each renamed tensor name
    (``common/model/weight_rules.py``).
    ``skipped_prefixes``: checkpoint tensors not served (vision tower, MTP head).
    ``renamed_prefixes``: (checkpoint prefix, ours) pairs applied before the weight rules.
    """

    text_model_type: str
    model_module: str
    defaults: Mapping[str, object]
    wrapper_model_type: str | None = None
    fixed: Mapping[str, object] = field(default_factory=dict)
    skipped_prefixes: tuple[str, ...] = ()
    renamed_prefixes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # read-only views: a family is shared by every config it parses
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))

    @property
    def wrapper(self) -> type[HybridForCausalLM]:
        """The causal-LM class built for this family (imports its model code, and torch)."""
        wrapper = importlib.import_module(self.model_module).WRAPPER
        if wrapper.model_types != (self.text_model_type,):
            raise ValueError(f"{wrapper.__name__} serves {wrapper.model_types}, not the "
                             f"family's {self.text_model_type!r}")
        return wrapper

    @property
    def weight_rules(self) -> tuple[WeightRule, ...]:
        """The family's weight rules, tried in order on each renamed checkpoint tensor name."""
        return tuple(importlib.import_module(self.model_module).WEIGHT_RULES)

    @property
    def model_types(self) -> tuple[str, ...]:
        """Every ``config.json`` ``model_type`` this family parses."""
        if self.wrapper_model_type is None:
            return (self.text_model_type,)
        return (self.text_model_type, self.wrapper_model_type)

    def parse(self, cfg: dict) -> ModelConfig:
        """Parse a ``config.json`` dict of one of :attr:`model_types`."""
        model_type = cfg.get("model_type")
        if model_type not in self.model_types:
            raise ConfigError(f"the {self.text_model_type} family parses {list(self.model_types)}, "
                              f"not {model_type!r}")
        is_wrapper = model_type == self.wrapper_model_type
        text = self._text_config(cfg) if is_wrapper else dict(cfg)
        if text.get("model_type") != self.text_model_type:
            raise ConfigError(f"a {model_type} config holds a text config of model_type "
                              f"{text.get('model_type')!r}, expected {self.text_model_type!r}")
        merged = {**self.defaults, **{k: v for k, v in text.items() if v is not None},
                  **self.fixed}
        return ModelConfig.from_fields(self.text_model_type, merged, is_wrapper=is_wrapper,
                                       raw=cfg)

    def checkpoint_name(self, raw_name: str) -> str | None:
        """Our name for checkpoint tensor ``raw_name``, or None for a tensor not served."""
        if raw_name.startswith(self.skipped_prefixes):
            return None
        for theirs, ours in self.renamed_prefixes:
            if raw_name.startswith(theirs):
                return ours + raw_name[len(theirs):]
        return raw_name

    def _text_config(self, cfg: dict) -> dict:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", self.text_model_type)
        # small wrapper checkpoints keep tie_word_embeddings at the top level only
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        for key in _INHERITED_BY_TEXT:
            if key not in text and key in cfg:
                text[key] = cfg[key]
        return text
