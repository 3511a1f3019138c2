"""The draft graphs' proposals launched ahead (``CudaGraphConfig.draft_ahead``: the next step's
draft launched from the commit's bonus tokens and lengths on the device, before the host reads
the step), run eagerly on the CPU (``capture=False``): every step's proposals equal those
launched after the read, through batches that shrink, grow and pad, contexts that cross pages,
and requests that join mid-way; tokens and accept lengths equal, nothing leaked. The shipped
trained pair in fp32 (``ahead_runs``)."""

from __future__ import annotations

import pytest
import torch

from common.engine.speculative import _DraftAhead
from tests.common.engine.ahead_runs import (CACHE, count_calls, eager_engine, fp32_pair,
                                          run_with_joins)


@pytest.fixture(scope="module")
def pair():
    return fp32_pair()


def _run(engine) -> tuple[list, list, dict]:
    """Every step's proposals, the requests of ``run_with_joins``, and how often each draft
    launch ran."""
    spec = engine.speculator
    proposals = []
    propose = spec.propose
    spec.propose = lambda reqs, pages: (lambda d: (proposals.append(d.clone()), d)[1])(
        propose(reqs, pages))
    calls = count_calls(spec.draft_graphs, "run", "run_next")
    return proposals, run_with_joins(engine), calls


def test_proposals_launched_ahead_equal_those_launched_after_the_read(pair):
    want_props, want_reqs, want_calls = _run(eager_engine(pair))
    engine = eager_engine(pair, draft_ahead=True)
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got_props, got_reqs, got_calls = _run(engine)
    assert len(got_props) == len(want_props)
    for step, (g, w) in enumerate(zip(got_props, want_props)):
        assert torch.equal(g, w), step
    assert [r.output_ids for r in got_reqs] == [r.output_ids for r in want_reqs]
    assert [r.accept_lengths for r in got_reqs] == [r.accept_lengths for r in want_reqs]
    # steps of the same requests took the draft launched ahead; the batch's changes did not
    assert want_calls["run_next"] == 0 and got_calls["run_next"] > 5
    assert got_calls["run"] < want_calls["run"] - 5
    # the longest request's context crossed ten pages while its drafts were launched ahead
    assert max(len(r.output_ids) for r in got_reqs) >= 10 * CACHE.page_size
    assert max(n for r in got_reqs for n in r.accept_lengths) > 2
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


class _Request:
    def __init__(self, num_cached: int, last: int) -> None:
        self.num_cached, self.output_ids = num_cached, [7, last]


def test_a_proposal_ahead_fits_only_the_rows_it_assumed():
    a, b = _Request(10, 3), _Request(20, 4)
    ahead = _DraftAhead((a, b), (10, 20), (3, 4), torch.zeros(2, 3))
    assert ahead.fits([a, b])
    assert not ahead.fits([b, a])  # another order
    assert not ahead.fits([a])  # a request left
    assert not ahead.fits([a, b, _Request(5, 1)])  # one joined
    b.num_cached = 12  # moved since (preempted and prefilled again, say)
    assert not ahead.fits([a, b])
    b.num_cached, b.output_ids[-1] = 20, 9  # its last token is not the bonus (a stop token)
    assert not ahead.fits([a, b])
