"""benchmarks/shapes.py: the larger trained pair's geometry, for timing its steps with random
weights, is the pair docs/training.md trains."""

from __future__ import annotations

import torch

from benchmarks.shapes import DRAFTS, PYCODER_LARGE_DRAFT, SHAPES, shape_config
from common.model.dflash_config import DFlashConfig
from common.model.family_registry import model_class_for
from common.training.draft_config import DraftArch
from common.training.draft_setup import draft_config_dict


def test_the_larger_target_has_the_trained_ones_parameters():
    config = shape_config("pycoder-large")
    with torch.device("meta"):
        model = model_class_for(config)(config)
    # "278.8M parameters" in every training run's log (docs/training.md)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 278.8


def test_the_larger_draft_is_what_train_draft_makes_for_that_target_by_default():
    target = shape_config("pycoder-large")
    made = draft_config_dict(target, DraftArch(), mask_token_id=1, dtype="bfloat16")
    for key, value in PYCODER_LARGE_DRAFT.items():
        if key != "dflash_config":
            assert made[key] == value, key
    assert made["dflash_config"]["target_layer_ids"] == [1, 17]
    assert PYCODER_LARGE_DRAFT["dflash_config"]["target_layer_ids"] == [1, 17]
    config = DFlashConfig.from_dict(dict(PYCODER_LARGE_DRAFT), target=target)
    assert config.block_size == 16


def test_every_draft_belongs_to_a_shape():
    assert set(DRAFTS) <= set(SHAPES)
