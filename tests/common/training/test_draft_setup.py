"""A new draft's config for a target, its initial weights, and how it is written."""

from __future__ import annotations

import pytest
import torch

from common.model.dflash import DFlashDraftModel, load_draft
from common.model.dflash_config import DFlashConfig
from common.model.load import load_model
from common.tokenizer import ByteTokenizer, TokenIdsOnly
from common.training.draft_config import DraftArch
from common.training.draft_setup import (draft_config_dict, init_draft_weights,
                                         resolve_mask_token_id, save_draft)


@pytest.fixture(scope="module")
def target():
    return load_model("tiny")


def test_mask_token(target):
    cfg = target.config
    assert resolve_mask_token_id(None, ByteTokenizer(), cfg) == ByteTokenizer.MASK_TOKEN_ID
    assert resolve_mask_token_id(5, None, cfg) == 5
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        resolve_mask_token_id(260, None, cfg)
    with pytest.raises(ValueError, match="--mask-token-id"):
        resolve_mask_token_id(None, None, cfg)

    class BytesOnly(ByteTokenizer):  # no mask token, and the model has rows past its ids
        def encode(self, text, *, add_special_tokens=True):
            return list(text.encode())

        @property
        def vocab_size(self):
            return 256

    assert resolve_mask_token_id(None, BytesOnly(), cfg) == 256
    with pytest.raises(ValueError):
        resolve_mask_token_id(None, TokenIdsOnly("x"), cfg)


def test_config_follows_the_target(target):
    cfg = draft_config_dict(target.config, DraftArch(num_layers=3, block_size=8),
                            mask_token_id=257, dtype="float32")
    parsed = DFlashConfig.from_dict(cfg, target=target.config)
    assert parsed.hidden_size == 128 and parsed.num_hidden_layers == 3
    assert parsed.num_attention_heads == 4 and parsed.num_key_value_heads == 2
    assert parsed.head_dim == 128 and parsed.intermediate_size == 256
    assert parsed.block_size == 8 and parsed.mask_token_id == 257
    assert parsed.target_layer_ids == (1,)  # z-lab's [1, 1, 1] for 4 layers, repeats dropped
    custom = draft_config_dict(target.config, DraftArch(target_layer_ids=(0, 3), head_dim=32,
                                                        num_heads=2, num_kv_heads=1),
                               mask_token_id=257, dtype="bfloat16")
    assert custom["dflash_config"]["target_layer_ids"] == [0, 3]
    assert (custom["num_attention_heads"], custom["num_key_value_heads"]) == (2, 1)
    with pytest.raises(ValueError):
        DraftArch(block_size=1)


def test_saved_draft_loads_bit_for_bit(target, tmp_path):
    cfg = draft_config_dict(target.config, DraftArch(block_size=4, head_dim=32),
                            mask_token_id=257, dtype="float32")
    draft = DFlashDraftModel(DFlashConfig.from_dict(cfg, target=target.config),
                             dtype=torch.float32)
    init_draft_weights(draft, seed=4)
    norms = [p for n, p in draft.named_parameters() if n.endswith("norm.weight")]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    assert 0.015 < draft.fc.weight.std() < 0.025
    save_draft(draft, cfg, tmp_path, dtype="float32")
    loaded = load_draft(str(tmp_path), target)
    for (n1, p1), (n2, p2) in zip(draft.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    save_draft(draft, cfg, tmp_path / "bf16", dtype="bfloat16")
    assert load_draft(str(tmp_path / "bf16"), target).fc.weight.dtype == torch.float32  # target's
