"""The draft's training forward against its inference path, the block mask, and the loss."""

from __future__ import annotations

import pytest
import torch

from common.model.builtin import fill_draft_deterministic
from common.model.dflash import DFlashDraftModel, DraftKVPool
from common.model.dflash_config import DFlashConfig
from common.model.load import load_model
from common.training.capture import HiddenCapture
from common.training.draft_forward import (accept_runs, block_hidden, block_logits, block_loss,
                                           block_mask, sample_anchors)
from tests.common.model.draft_checkpoints import draft_config_dict

B, T, MASK = 6, 20, 257
VARIANTS = {
    "full": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "sliding_noncausal": dict(layer_types=["sliding_attention", "full_attention"],
                              sliding_window=6, is_causal=False),
    "causal_bias_scaled": dict(is_causal=True, attention_bias=True,
                               dflash_config={"target_layer_ids": [0, 2, 3],
                                              "mask_token_id": MASK,
                                              "output_multiplier": 0.5,
                                              "final_logit_softcapping": 20.0}),
}


@pytest.fixture(scope="module")
def target():
    return load_model("tiny")


def make_draft(target, variant, seed=3):
    cfg = draft_config_dict(target.config, block_size=B, mask_token_id=MASK,
                            target_layer_ids=[0, 2, 3])
    cfg.update(VARIANTS[variant])
    draft = DFlashDraftModel(DFlashConfig.from_dict(cfg, target=target.config),
                             dtype=torch.float32)
    fill_draft_deterministic(draft.named_parameters(), seed=seed)
    return draft


def batch(target, draft, seed=0):
    tokens = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(seed))
    aux = HiddenCapture(target, draft.config.target_layer_ids, max_sequences=2, seq_len=T,
                        device="cpu")(tokens)
    return tokens, aux


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_block_equals_propose_after_its_context(target, variant):
    """Block j of sequence s, trained in one pass with all others, is what propose() gives
    once the a = anchors[s, j] tokens before it are the committed context."""
    draft = make_draft(target, variant)
    tokens, aux = batch(target, draft)
    anchors = sample_anchors(2, T, B, 5, generator=torch.Generator().manual_seed(1))
    embed, head = target.get_input_embeddings().weight, target.get_output_weight()
    got = block_logits(draft, block_hidden(draft, aux, tokens, anchors, embed)[:, :, 1:], head)
    assert got.shape == (2, 5, B - 1, 260)
    for s in range(2):
        for j, a in enumerate(anchors[s].tolist()):
            pool = DraftKVPool(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2,
                               head_dim=16, dtype=torch.float32)
            pos = torch.arange(a)
            draft.extend_context(aux[s, :a], pos, pos + 4, pool)  # pages 1, 2, ... in order
            block = torch.tensor([[int(tokens[s, a])] + [MASK] * (B - 1)])
            ref = draft.propose(block_ids=block, start_positions=[a],
                                page_table=torch.arange(1, 8)[None], pool=pool, embed=embed,
                                lm_head=head)[0]
            assert ((got[s, j] - ref).abs().max() / ref.abs().max()).item() <= 1e-5
            assert torch.equal(got[s, j].argmax(-1), ref.argmax(-1))


def test_anchors():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(3, 20, 6, 8, generator=gen)
    assert a.shape == (3, 8) and a.min() >= 1 and a.max() <= 14
    assert all(len(set(row)) == 8 and row == sorted(row) for row in a.tolist())
    assert sample_anchors(1, 8, 6, 10, generator=gen).tolist() == [[1, 2]]  # every position
    with pytest.raises(ValueError, match="seq_len > block_size"):
        sample_anchors(1, 6, 6, 1, generator=gen)


def test_anchors_with_labels_come_before_the_next_label():
    labels = torch.zeros(2, 20, dtype=torch.bool)
    labels[0, 8:] = True          # anchors 7.. predict a label first
    labels[1, 3:6] = True         # only anchors 2, 3 and 4 do
    a = sample_anchors(2, 20, 6, 4, generator=torch.Generator().manual_seed(0), labels=labels)
    assert a.shape == (2, 4) and a[0].min() >= 7 and a[0].max() <= 14
    assert {2, 3, 4} <= set(a[1].tolist())
    # without labels the draw is the one every earlier draft was trained with
    plain = sample_anchors(3, 20, 6, 8, generator=torch.Generator().manual_seed(4))
    order = torch.rand(3, 14, generator=torch.Generator().manual_seed(4)).argsort(dim=1)
    assert torch.equal(plain, (order[:, :8] + 1).sort(dim=1).values)


def test_rows_that_are_not_labels_weigh_nothing(target):
    draft = make_draft(target, "full")
    tokens, aux = batch(target, draft)
    anchors = torch.tensor([[2, 9], [4, 12]])
    kwargs = dict(embed=target.get_input_embeddings().weight,
                  lm_head=target.get_output_weight(), loss_decay_gamma=7.0)
    labels = torch.ones(2, T, dtype=torch.bool)
    full = block_loss(draft, aux, tokens, anchors, **kwargs)
    same = block_loss(draft, aux, tokens, anchors, labels=labels, **kwargs)
    for name in ("loss", "accuracy", "accept_length"):
        assert torch.allclose(getattr(full, name), getattr(same, name), atol=1e-6), name
    # rows 12..14 of block (0, 9) and the whole block (1, 12) stop counting; changing the
    # tokens there changes the plain loss, never the labelled one
    labels[0, 12:15] = False
    labels[1, 13:] = False
    before = block_loss(draft, aux, tokens, anchors, labels=labels, **kwargs)
    other = tokens.clone()
    other[0, 12:15] = (other[0, 12:15] + 1) % 256
    other[1, 13:] = (other[1, 13:] + 1) % 256
    after = block_loss(draft, aux, other, anchors, labels=labels, **kwargs)
    assert torch.allclose(before.loss, after.loss) and before.accuracy == after.accuracy
    assert not torch.allclose(block_loss(draft, aux, other, anchors, **kwargs).loss, full.loss)
    # a block whose first row is no label is no block: its accept length is not averaged in
    one = torch.zeros(2, T, dtype=torch.bool)
    one[0, 3:8] = True
    only = block_loss(draft, aux, tokens, anchors[:, :1], labels=one, **kwargs)
    alone = block_loss(draft, aux[:1], tokens[:1], anchors[:1, :1], **kwargs)
    assert torch.allclose(only.loss, alone.loss, atol=1e-6)
    assert torch.allclose(only.accept_length, alone.accept_length)


def test_block_mask():
    anchors = torch.tensor([[2, 5]])
    m = block_mask(anchors, 8, 3, causal=False, window=None)[0, 0]
    assert m.shape == (6, 8 + 6)
    # block 0 (positions 2..4): context 0, 1 and its own three keys, never block 1
    assert m[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] + [1, 1, 1] + [0, 0, 0]
    assert m[4].tolist() == [1] * 5 + [0] * 3 + [0, 0, 0] + [1, 1, 1]
    causal = block_mask(anchors, 8, 3, causal=True, window=None)[0, 0]
    assert causal[0, 8:].tolist() == [1, 0, 0, 0, 0, 0] and causal[2, 8:11].tolist() == [1, 1, 1]
    window = block_mask(anchors, 8, 3, causal=True, window=2)[0, 0]
    assert window[5].tolist() == [0] * 8 + [0, 0, 0] + [0, 1, 1]  # position 7 sees 6 and 7


def test_loss_trains_every_parameter(target):
    draft = make_draft(target, "full")
    draft.requires_grad_(True)
    tokens, aux = batch(target, draft)
    anchors = sample_anchors(2, T, B, 4, generator=torch.Generator().manual_seed(2))
    kwargs = dict(embed=target.get_input_embeddings().weight,
                  lm_head=target.get_output_weight(), loss_decay_gamma=7.0)
    first = block_loss(draft, aux, tokens, anchors, **kwargs)
    first.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(15):
        opt.zero_grad()
        out = block_loss(draft, aux, tokens, anchors, **kwargs)
        out.loss.backward()
        opt.step()
    after = block_loss(draft, aux, tokens, anchors, **kwargs)
    assert after.loss < 0.7 * first.loss
    assert after.accuracy > first.accuracy and after.accept_length >= 1.0


def test_accept_runs_count_the_leading_correct_rows():
    correct = torch.tensor([[True, True, False, True], [False, True, True, True],
                            [True, True, True, True]])
    assert accept_runs(correct).tolist() == [3, 1, 5]
