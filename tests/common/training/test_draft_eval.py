"""The held-out evaluation of train-draft: the decode walk, the held-out split, and that the
chunked evaluation agrees with the training objective on the same blocks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from common.model.dflash import load_draft
from common.model.load import load_model
from common.training.capture import HiddenCapture
from common.training.draft_eval import HeldOutSet, decode_walk, split_held_out
from common.training.draft_forward import block_loss
from common.training.train_draft import train_draft

from tests.common.training.test_train_draft import config_for


def test_decode_walk_steps_from_each_runs_first_token():
    # tokens 0-1 a prompt, 2-7 the target's, 8 a separator, 9-11 the next prompt's; B = 3
    labels = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    lengths = torch.tensor([1, 3, 1, 2, 2, 3, 1, 1, 1])  # L(a) for anchors 1..9
    # the run 2..7 starts at 2: L(2)=3 -> 5, L(5)=2 -> 7 is its last token
    assert decode_walk(lengths, labels) == (2, 5)
    # a step never yields past the run's last token: from 5, L(5)=3 would reach 8
    assert decode_walk(torch.tensor([1, 3, 1, 2, 3, 3, 1, 1, 1]), labels) == (2, 5)
    # a run under way at the window's start is walked from token 1
    assert decode_walk(torch.tensor([2, 1, 1, 4, 1]), torch.ones(8, dtype=torch.bool)) == (3, 6)
    assert decode_walk(torch.ones(5, dtype=torch.long), torch.zeros(8, dtype=torch.bool)) == (0, 0)


def test_uniform_anchor_mean_overstates_the_decode_tau():
    # half the text easy (the draft right 15 rows ahead), half hard (never right): uniform
    # anchors average 9, a decode spends most of its steps on the hard half
    labels = torch.ones(200, dtype=torch.bool)
    lengths = torch.tensor([16 if a < 100 else 1 for a in range(1, 185)])
    steps, tokens = decode_walk(lengths, labels)
    # anchors 1, 17, .., 97 (7 steps of 16), then 113 .. 184 one token a step
    assert (steps, tokens) == (7 + 72, 7 * 16 + 72)
    assert lengths.float().mean() > 3 * tokens / steps


def test_split_holds_out_every_kth_document():
    docs = [f"doc {i}" for i in range(10)]
    kept, held = split_held_out(docs, 0.25)
    assert held == ["doc 3", "doc 7"] and kept == [d for d in docs if d not in held]
    assert split_held_out(docs, 0.0) == (docs, [])
    assert split_held_out(docs[:3], 0.25) == (docs[:3], [])  # too few to spare one
    with pytest.raises(ValueError, match="eval_fraction"):
        split_held_out(docs, 1.0)


def test_evaluation_agrees_with_the_training_objective(trained_draft_for_tiny, monkeypatch):
    target = load_model("tiny")
    draft = load_draft(str(trained_draft_for_tiny), target, dtype=torch.float32)
    b, t = draft.config.block_size, 24
    gen = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 256, (200,), generator=gen, dtype=torch.int32)
    labels = torch.rand(200, generator=gen) < 0.8
    held = HeldOutSet(stream, labels, t, count=3)
    capture = HiddenCapture(target, draft.config.target_layer_ids, max_sequences=3, seq_len=t,
                            device="cpu")
    embed, head = target.get_input_embeddings().weight, target.get_output_weight()
    got = held.evaluate(5, draft=draft, capture=capture, embed=embed, lm_head=head,
                        loss_decay_gamma=7.0, batch_size=2, autocast=False)
    # every anchor at once through the training objective
    anchors = torch.arange(1, t - b + 1).expand(3, -1)
    with torch.no_grad():
        want = block_loss(draft, capture(held.tokens), held.tokens, anchors, embed=embed,
                          lm_head=head, loss_decay_gamma=7.0, labels=held.labels)
    assert got.step == 5
    assert got.loss == pytest.approx(float(want.loss), rel=1e-5)
    assert got.accept_length == pytest.approx(float(want.accept_length), rel=1e-6)
    assert 1.0 <= got.tau <= b
    # a few anchors at a time (as for a large vocabulary): the same figures
    from common.training import draft_eval

    monkeypatch.setattr(draft_eval, "LOGITS_BUDGET", 3 * 2 * (b - 1) * head.shape[0])
    chunked = held.evaluate(5, draft=draft, capture=capture, embed=embed, lm_head=head,
                            loss_decay_gamma=7.0, batch_size=2, autocast=False)
    assert chunked.tau == got.tau and chunked.accept_length == pytest.approx(got.accept_length)
    assert chunked.loss == pytest.approx(got.loss, rel=1e-6)


@pytest.fixture(scope="module")
def trained_draft_for_tiny(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft_eval")
    train_draft(replace(config_for(corpus_dir, out, 4), eval_fraction=0.0))
    return out


def test_train_draft_evaluates_held_out_documents(corpus_dir, tmp_path):
    lines = [{"token_ids": [(7 * i + j) % 250 for j in range(40)], "prompt_tokens": 24}
             for i in range(8)]
    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    p = train_draft(replace(config_for(data, tmp_path / "a", 6), data=str(data),
                            eval_fraction=0.25, eval_points=3, eval_windows=2))
    held = p["held_out"]
    assert held["documents"] == 2 and held["source"] == "every 4th document of the data"
    assert p["data_tokens"] == 6 * 41 and held["tokens"] == 2 * 41  # kept out of training
    assert [e["step"] for e in held["evaluations"]] == [2, 4, 6]
    assert all(e["loss"] > 0 and 1 <= e["tau"] <= 6 for e in held["evaluations"])
    # the named held-out data instead; without any, no evaluation
    p = train_draft(replace(config_for(data, tmp_path / "b", 2), data=str(data),
                            eval_data=str(data), eval_windows=2))
    assert p["data_tokens"] == 8 * 41 and p["held_out"]["source"] == str(data)
    p = train_draft(replace(config_for(data, tmp_path / "c", 2), data=str(data),
                            eval_fraction=0.0))
    assert p["held_out"] == {}
