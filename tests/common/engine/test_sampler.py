"""The sampler (common/engine/sampler.py) and the sampling parameters it applies
(common/sampling.py)."""

import pytest
import torch

from common.engine.sampler import Sampler, filtered_probs, make_generator
from common.sampling import SamplingParams, stop_reason


def _logits(n: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def test_greedy_equals_argmax():
    logits = _logits(6, 50)
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1  # a tie: the first index wins
    params = [SamplingParams(temperature=0.0)] * 6
    out = Sampler().sample(logits, params, [None] * 6)
    assert out.dtype == torch.long
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[2].item() == 7


def test_seeded_sampling_reproducible_and_batch_independent():
    logits = _logits(4, 100)
    p = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler()

    def run(rows, params, seeds):
        gens = [make_generator(s, "cpu") for s in seeds]
        return [sampler.sample(rows, params, gens).tolist() for _ in range(20)]

    alone = run(logits[:1], [p], [1234])
    assert alone == run(logits[:1], [p], [1234])
    # Same request in row 2, next to greedy, unseeded and differently seeded companions.
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        p,
        SamplingParams(temperature=1.3, seed=99),
    ]
    batch = torch.cat([logits[1:2], logits[2:3], logits[:1], logits[3:4]])
    together = run(batch, companions, [None, None, 1234, 99])
    assert [row[2] for row in together] == [row[0] for row in alone]
    assert len({row[0] for row in alone}) > 1  # it really is random


def test_top_k_one_equals_greedy():
    logits = _logits(8, 40)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    out = Sampler().sample(logits, params, [None] * 8)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_tiny_top_p_keeps_only_top_token():
    logits = _logits(5, 30)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 5
    probs = filtered_probs(logits, params)
    expected = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(probs, expected)
    out = Sampler().sample(logits, params, [None] * 5)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # 0.5 < 0.6, 0.5 + 0.3 >= 0.6: the first two stay.
    probs = filtered_probs(logits, SamplingParams(top_p=0.6))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = filtered_probs(logits, SamplingParams(top_p=0.5))
    assert torch.allclose(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_min_p_filtering():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # threshold 0.4 * 0.4 = 0.16: only 0.1 is below it.
    probs = filtered_probs(logits, SamplingParams(min_p=0.4))
    assert torch.allclose(probs, torch.tensor([4, 3, 2, 0]) / 9)
    probs = filtered_probs(logits, SamplingParams(min_p=0.6))
    assert torch.allclose(probs, torch.tensor([4, 3, 0, 0]) / 7)


def test_filtered_probs_normalised_and_zeroes_filtered():
    logits = _logits(4, 64, seed=3)
    params = [
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.0),
    ]
    probs = filtered_probs(logits, params)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    assert (probs[0] > 0).sum() == 10
    top10 = logits[0].topk(10).indices
    assert set(probs[0].nonzero().flatten().tolist()) == set(top10.tolist())
    assert (probs[1] == 0).any() and (probs[2] == 0).any()
    assert probs[3].max() == 1.0 and probs[3].argmax() == logits[3].argmax()
    # Unfiltered rows are plain softmax(logits / T), with no token zeroed.
    plain = filtered_probs(logits[0], SamplingParams(temperature=0.5))
    assert torch.allclose(plain, torch.softmax(logits[0] / 0.5, -1))
    # Row-wise equals batched.
    for i, p in enumerate(params):
        assert torch.allclose(filtered_probs(logits[i], p), probs[i])


def test_empirical_distribution_matches_filtered_probs():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0]])
    p = SamplingParams(temperature=0.7, top_k=3, seed=7)
    expected = filtered_probs(logits, [p])[0]
    assert (expected[3:] == 0).all()
    n = 20_000
    gen = make_generator(p.seed, "cpu")
    sampler = Sampler()
    # n copies of one row sharing one generator: n consecutive draws of one seeded stream.
    draws = sampler.sample(logits.expand(n, -1), [p] * n, [gen] * n)
    counts = torch.bincount(draws, minlength=5).float()
    assert counts[3:].sum() == 0
    e = expected[:3] * n
    chi2 = ((counts[:3] - e) ** 2 / e).sum().item()
    # 2 degrees of freedom: P(chi2 > 13.8) = 0.001.
    assert chi2 < 13.8, (counts, e)


def test_rows_on_the_default_rng_and_seeded_rows_in_one_batch_each_follow_their_distribution():
    """The exponential race in a batch mixing unseeded rows (one draw of noise for all of them)
    with seeded ones (a noise row each): every row's tokens follow its own distribution."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0], [0.0, 0.5, 1.0, 1.5, 2.0]])
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=1.2, top_k=4, seed=3)]
    n = 10_000
    rows = logits.repeat(n, 1)
    gen = make_generator(3, "cpu")
    draws = Sampler().sample(rows, params * n, [None, gen] * n).view(n, 2)
    for r in range(2):
        expected = filtered_probs(logits[r], params[r]) * n
        counts = torch.bincount(draws[:, r], minlength=5).float()
        kept = expected > 0
        assert counts[~kept].sum() == 0
        chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
        # 4 or 3 degrees of freedom: P(chi2 > 18.5) < 0.001
        assert chi2 < 18.5, (r, counts, expected)


def test_sampler_works_on_bf16_logits():
    logits = _logits(3, 20).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=2), SamplingParams(top_p=0.5)]
    out = Sampler().sample(logits, params, [None, make_generator(0, "cpu"), None])
    assert out.shape == (3,) and out[0] == logits[0].argmax()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": (1, -3)}, "stop_token_ids"),
        ({"speculative": 1}, "speculative"),
        ({"speculative": "on"}, "speculative"),
    ],
)
def test_validation_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_and_coercion():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(top_k=-1).top_k == -1
    assert p.speculative is None and SamplingParams(speculative=False).speculative is False
    hash(SamplingParams(stop_token_ids=[1]))


def test_sampler_shape_errors():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(5), [SamplingParams()], [None])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError):
        filtered_probs(torch.zeros(2, 5), [SamplingParams()])


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a = torch.rand(3, generator=make_generator(5, "cpu"))
    b = torch.rand(3, generator=make_generator(5, torch.device("cpu")))
    assert torch.equal(a, b)


def test_stop_reason():
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(42,))
    eos = (2,)
    assert stop_reason(5, 1, p, eos) is None
    assert stop_reason(42, 1, p, eos) == "stop"
    assert stop_reason(2, 1, p, eos) == "stop"
    assert stop_reason(5, 3, p, eos) == "length"
    assert stop_reason(42, 3, p, eos) == "stop"
    ignore = SamplingParams(max_new_tokens=3, stop_token_ids=(42,), ignore_eos=True)
    assert stop_reason(2, 1, ignore, eos) is None
    assert stop_reason(42, 1, ignore, eos) == "stop"
    assert stop_reason(2, 3, ignore, eos) == "length"


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-39, 1e-20, 9.9e-6])
def test_tiny_temperatures_sample_as_greedy(temperature):
    """Dividing by a temperature this small overflows fp32 (inf logits, NaN softmax)."""
    logits = torch.randn(5, 97) * 30
    params = [SamplingParams(temperature=temperature, top_p=0.9, top_k=7, min_p=0.1)] * 5
    assert all(p.is_greedy for p in params)
    gens = [make_generator(i, "cpu") for i in range(5)]
    assert torch.equal(Sampler().sample(logits, params, gens), logits.argmax(-1))
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.all(probs.max(-1).values == 1)


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 1e300])
def test_small_and_huge_temperatures_give_finite_distributions(temperature):
    logits = torch.randn(3, 50) * 1e4
    for extra in ({}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.9}):
        params = SamplingParams(temperature=temperature, **extra)
        probs = filtered_probs(logits, params)
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(3))
        Sampler().sample(logits, [params] * 3, [None] * 3)  # draws without raising


def test_rejection_sampling_at_tiny_temperature_is_greedy():
    from common.engine.acceptance import accept_sampled

    logits = torch.randn(4, 31) * 5
    choice = logits.argmax(-1)
    drafts = choice[:3].clone()
    drafts[2] = (choice[2] + 1) % 31  # the third draft is wrong
    out = accept_sampled(drafts, logits, SamplingParams(temperature=1e-300), None)
    assert (out.num_accepted, out.bonus) == (2, int(choice[2]))
