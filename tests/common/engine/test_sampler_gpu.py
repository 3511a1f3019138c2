"""On a GPU the sampler queues its work behind the forward without waiting for it: no copy from
pageable memory, no read of a device value (``torch.cuda.set_sync_debug_mode("error")`` raises
at any synchronising call). Overlap scheduling samples a launched step this way, and a wait
there would stall the host until that step's forward ends."""

from __future__ import annotations

import pytest
import torch

from common.engine.sampler import Sampler, filtered_probs, make_generator
from common.sampling import SamplingParams

pytestmark = pytest.mark.gpu

MIXED = [SamplingParams(temperature=0.0),
         SamplingParams(temperature=0.7, seed=11),
         SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.8, top_k=5, seed=12),
         SamplingParams(temperature=0.9, top_p=0.9),
         SamplingParams(temperature=1.1, min_p=0.1, seed=13)]


def _no_host_wait(fn):
    fn()  # the pinned staging blocks exist after a first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("params", [MIXED, MIXED[1:], [MIXED[2]] * 3],
                         ids=["with greedy rows", "sampled only", "unseeded only"])
def test_sampling_a_batch_never_waits_for_the_device(params):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    logits = torch.randn(len(params), 997, device="cuda")
    gens = [make_generator(p.seed, "cuda") for p in params]
    out = _no_host_wait(lambda: Sampler().sample(logits, params, gens))
    probs = _no_host_wait(lambda: filtered_probs(logits, params))
    torch.cuda.synchronize()
    assert out.shape == (len(params),)
    chosen = probs.gather(1, out.view(-1, 1)).squeeze(1)
    assert bool((chosen > 0).all())  # every row drew a token its distribution keeps
    if params[0].is_greedy:
        assert int(out[0]) == int(logits[0].argmax())
