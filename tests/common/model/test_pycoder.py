"""The shipped pycoder pair (common/model/weights/): it loads by name, its draft is trained (it
is accepted on the target's own kind of text), and in fp32 greedy output with the draft equals
plain greedy output token for token, with the reference kernels and with the CPU set (whose
verify and commit run the chunked form of the rule). (In the checkpoint's bf16, two logits are often one bf16
step apart, so a verify forward and a decode step can break a tie differently:
docs/training.md.)"""

from __future__ import annotations

import pytest
import torch

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.dflash import load_draft
from common.model.kernels import select_kernels
from common.model.load import load_model
from common.sampling import SamplingParams
from common.tokenizer import load_tokenizer

# a CPU verify step of this pair costs several decode steps (docs/bench.md), so few tokens
PROMPTS = ("def read_lines(path):\n    with open(path",)


@pytest.fixture(scope="module")
def pair():
    target = load_model("pycoder", dtype=torch.float32)
    draft = load_draft("pycoder", target)
    return target, draft, load_tokenizer("pycoder")


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_greedy_with_the_shipped_draft_equals_plain_greedy_in_fp32(pair, kernels):
    target, draft, tokenizer = pair
    target.kernels = draft.kernels = select_kernels(kernels)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    cache = CacheConfig(page_size=16, num_pages=32)
    plain = LLMEngine(target, EngineConfig(cache=cache)).generate(prompts, params)
    target.set_dflash_layers_to_capture(draft.config.target_layer_ids)
    try:
        spec = LLMEngine(target, EngineConfig(cache=cache), draft=draft,
                         block_size=draft.config.block_size).generate(prompts, params)
    finally:
        target.set_dflash_layers_to_capture(())
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    # a trained draft: some block is accepted beyond its first token (an untrained one gives
    # accept length 1 every step)
    assert max(n for r in spec for n in r.accept_lengths) > 2
    # and the target writes code: the first continuation opens the file with a mode
    assert "'" in tokenizer.decode(plain[0].output_ids)
