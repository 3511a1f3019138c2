"""What the tests of DFLASH steps launched ahead share: the shipped trained pair (its blocks are
accepted to different lengths, so a step moved by the wrong length shows; an untrained draft's
are all 1), code prompts for it, a count of a runner's launches, and (on the CPU) an engine of
the graph path run eagerly with a run whose batch shrinks, grows and pads."""

from __future__ import annotations

import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.request import Request
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import DFlashDraftModel, load_draft
from common.model.load import load_model
from common.model.qwen3_5 import HybridForCausalLM
from common.sampling import SamplingParams
from common.tokenizer import load_tokenizer

CODE = ("def read_lines(path):\n    with open(path", "import os\n\ndef main(", "class Point:\n",
        "    for i in range(len(", "    return self.")


def trained_pair(**load) -> tuple[HybridForCausalLM, DFlashDraftModel]:
    """The pycoder target (``load_model``'s keyword arguments) and its shipped draft."""
    model = load_model("pycoder", **load)
    return model, load_draft("pycoder", model)


def code_prompts(first: int = 0, n: int = len(CODE)) -> list[list[int]]:
    tokenizer = load_tokenizer("pycoder")
    return [tokenizer.encode(p) for p in CODE[first:first + n]]


def count_calls(obj, *names: str) -> dict[str, int]:
    """Wrap ``obj``'s methods ``names`` to count their calls; the live counts."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(obj, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(obj, name, counted)
    return calls


def fp32_pair() -> tuple[HybridForCausalLM, DFlashDraftModel]:
    """The pair in fp32 on the CPU, where greedy output with the draft is plain greedy output."""
    return trained_pair(dtype=torch.float32)


CACHE = CacheConfig(page_size=4, num_pages=400, num_slots=12)
BLOCK = 8


def eager_engine(pair, **ahead: bool) -> LLMEngine:
    """The graph path's buffers and padding, uncaptured (``capture=False``), with
    ``CudaGraphConfig``'s ``draft_ahead`` / ``verify_ahead`` as given."""
    model, draft = pair
    config = EngineConfig(cache=CACHE, cuda_graph=CudaGraphConfig(capture=False, **ahead),
                          scheduler=SchedulerConfig(max_running_requests=11))
    return LLMEngine(model, config, draft=draft, block_size=BLOCK)


def run_with_joins(engine: LLMEngine, logprobs: bool = False) -> list[Request]:
    """Three greedy requests, then two more once the first have taken four steps (the last
    asking for log-probabilities when ``logprobs``), run to their ends."""
    first = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                  ignore_eos=True))
             for p, n in zip(code_prompts(0, 3), (40, 14, 25))]
    for _ in range(4):
        engine.step()
    later = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                  ignore_eos=True,
                                                  logprobs=1 if logprobs and i else None))
             for i, (p, n) in enumerate(zip(code_prompts(3, 2), (30, 12)))]
    while engine.scheduler.num_requests:
        engine.step()
    return first + later
