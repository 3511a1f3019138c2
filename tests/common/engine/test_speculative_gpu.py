"""On the GPU: sampled DFLASH acceptance (rejection sampling on the logits' device, with the
request's CUDA generator) keeps the sampled output distribution of plain decoding."""

from __future__ import annotations

import pytest

from tests.common.engine.test_speculative import (chi_square, critical_value,
                                                  sample_continuations, small_models)

pytestmark = pytest.mark.gpu


def test_sampled_distribution_on_the_gpu_is_unchanged_by_speculation():
    target, draft = small_models()
    target, draft = target.to("cuda"), draft.to("cuda")
    plain = sample_continuations(target, None, device="cuda")
    speculated = sample_continuations(target, draft, device="cuda")
    stat, df = chi_square(speculated, plain)
    assert stat < critical_value(df), (stat, df)
