"""The ``cpu`` kernel set in a whole engine: greedy tokens equal the ``reference`` set's for
prompts of different lengths decoded together, with plain decoding and with DFLASH (the
built-in pycoder and its draft, a few tokens each)."""

from __future__ import annotations

import pytest

from common.engine.factory import EngineSettings, build_engine
from common.sampling import SamplingParams

PROMPTS = [[5, 17, 230, 41, 9, 77, 1200, 3],
           [88, 9, 400, 2, 19, 3300, 61, 7, 512, 29, 44, 18, 6000],
           [140, 21, 9]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def greedy_tokens(kernels: str, draft: str | None) -> list[list[int]]:
    engine = build_engine(EngineSettings(model="pycoder", draft=draft, kernels=kernels)).engine
    return [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("draft", [None, "pycoder"])
def test_cpu_set_decodes_the_reference_tokens(draft):
    assert greedy_tokens("cpu", draft) == greedy_tokens("reference", draft)
