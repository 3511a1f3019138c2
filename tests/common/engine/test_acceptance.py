"""common/engine/acceptance.py: the batched rejection sampling of sampled rows (its
losslessness is tested statistically through the engine in test_speculative.py)."""

from __future__ import annotations

import pytest
import torch

from common.engine import acceptance
from common.engine.acceptance import accept_sampled_rows
from common.engine.sampler import make_generator
from common.sampling import SamplingParams


def _batch(n=5, b=4, vocab=23, seed=0):
    torch.manual_seed(seed)
    logits = torch.randn(n, b, vocab) * 3
    drafts = torch.randint(0, vocab, (n, b - 1))
    drafts[0] = logits[0, :-1].argmax(-1)  # a row whose drafts are the likeliest tokens
    params = [SamplingParams(temperature=0.5 + 0.2 * i, top_k=0 if i % 2 else 6, seed=i)
              for i in range(n)]
    return drafts, logits, params


def test_rows_taken_in_chunks_give_what_one_chunk_gives(monkeypatch):
    drafts, logits, params = _batch()
    whole = accept_sampled_rows(drafts, logits, params,
                                [make_generator(p.seed, "cpu") for p in params])
    monkeypatch.setattr(acceptance, "CHUNK_ELEMENTS", 1)  # one row at a time
    rows = accept_sampled_rows(drafts, logits, params,
                               [make_generator(p.seed, "cpu") for p in params])
    assert rows == whole  # each row's draws come from its own generator, in the same order


def test_at_a_tiny_temperature_every_row_is_greedy():
    drafts, logits, _ = _batch(n=4)
    choice = logits.argmax(-1)  # [n, B]
    drafts = choice[:, :-1].clone()
    wrong_at = [0, 1, 3, 2]  # 3 = none wrong: every draft kept, the bonus is the last argmax
    for r, j in enumerate(wrong_at):
        if j < drafts.shape[1]:
            drafts[r, j] = (choice[r, j] + 1) % logits.shape[-1]
    params = [SamplingParams(temperature=1e-300)] * 4
    out = accept_sampled_rows(drafts, logits, params, [None] * 4)
    assert [(a.num_accepted, a.bonus) for a in out] == [
        (j, int(choice[r, j])) for r, j in enumerate(wrong_at)]


def test_a_batch_of_the_wrong_shape_is_refused():
    drafts, logits, params = _batch(n=3)
    with pytest.raises(ValueError, match="drafts"):
        accept_sampled_rows(drafts[:, :-1], logits, params, [None] * 3)
    with pytest.raises(ValueError, match="generator"):
        accept_sampled_rows(drafts, logits, params, [None] * 2)


def test_a_greedy_read_gives_the_outcome_as_it_was_when_started():
    matched = torch.tensor([[2, 0, 5], [11, 12, 13]])
    reader = acceptance.GreedyReader("cpu", rows=4)
    read = reader.start(matched)
    matched.fill_(7)  # what the device does after the copy was queued (the next step)
    got = read()
    assert [(a.num_accepted, a.bonus) for a in got] == [(2, 11), (0, 12), (5, 13)]
    assert got == acceptance.read_greedy(torch.tensor([[2, 0, 5], [11, 12, 13]]))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_a_greedy_read_on_the_gpu_waits_for_its_copy_only(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    matched = torch.tensor([[3, 1], [40, 41]], device="cuda")
    reader = acceptance.GreedyReader("cuda", rows=rows)
    torch.cuda._sleep(10_000_000)  # the step the outcome comes from, still running
    read = reader.start(matched)
    # starting the read queued the copy without waiting for the work before it
    assert not torch.cuda.current_stream().query()
    matched.fill_(0)
    torch.cuda._sleep(10_000_000)  # later work still running when the read returns
    assert [(a.num_accepted, a.bonus) for a in read()] == [(3, 40), (1, 41)]
    # the read did not wait for the stream: the sleep queued after the copy still runs
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
