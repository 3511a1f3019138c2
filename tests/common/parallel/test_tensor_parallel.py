"""Tensor parallelism end to end on the CPU: a gloo group of 2 and of 4 processes on 127.0.0.1
(this process is rank 0, the followers are spawned) gives the single-process model's logits to
fp32 rounding and its greedy tokens exactly, for every checkpoint kind, and for the MoE kinds
with experts split inside each expert and placed whole (expert parallelism).

One group per size serves every kind in turn (a follower loads each model when rank 0 does), so
the processes start twice in all.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.factory import EngineSettings, build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.model.forward_batch import ForwardMode
from common.parallel.launch import LocalGroup
from common.sampling import SamplingParams
from tests.common.model.checkpoints import KINDS, make_checkpoint

MOE_KINDS = ("qwen3_5_moe_text", "qwen3_next")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7] * 6]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True, logprobs=0)
# page size 4 and a prefill budget of 8 tokens: prompts span pages and are prefilled in chunks
CACHE = CacheConfig(page_size=4, num_pages=96, num_slots=5)


def build(path, tp=None, device: str = "cpu", expert_parallel: bool = False,
          draft: str | None = None):
    from common.engine.scheduler import SchedulerConfig

    world = 1 if tp is None else tp.world_size
    engine = EngineConfig(cache=CACHE, scheduler=SchedulerConfig(max_prefill_tokens=8),
                          device=device)
    return build_engine(EngineSettings(model=str(path), engine=engine, tensor_parallel_size=world,
                                       expert_parallel=expert_parallel, draft=draft),
                        tp=tp).engine


def prompt_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill of ``prompt``, through the engine's runner (so a
    tensor-parallel engine's followers run it too); the pages and slot are freed after."""
    pages = engine.kv_pool.allocator.allocate(engine.kv_pool.pages_for(len(prompt)))
    slot = engine.state_pool.allocate()
    try:
        out, _ = engine.runner.forward(dict(
            mode=ForwardMode.EXTEND, token_ids=[prompt], prefix_lens=[0], page_ids=[pages],
            page_size=engine.kv_pool.page_size, state_slots=[slot], return_all_logits=True))
    finally:
        engine.kv_pool.allocator.free(pages)
        engine.state_pool.free(slot)
    return out.logits


def outputs(engine):
    """Prompt logits, greedy tokens and their log-probabilities; the pools end full again."""
    free = engine.load()
    logits = [prompt_logits(engine, p) for p in PROMPTS]
    reqs = engine.generate(PROMPTS, GREEDY)
    assert engine.load() == free
    return logits, [r.output_ids for r in reqs], [[lp.logprob for lp in r.logprobs]
                                                  for r in reqs]


def speculative_outputs(engine):
    """Tokens and accept lengths of greedy and seeded sampled requests decoded with DFLASH;
    the pools end full again."""
    free = engine.load()
    params = [GREEDY, GREEDY,
              SamplingParams(temperature=0.8, seed=5, max_new_tokens=32, ignore_eos=True)]
    reqs = engine.generate(PROMPTS, params)
    assert engine.load()["free_pages"] == free["free_pages"]
    assert all(r.accept_lengths for r in reqs)  # every request speculated
    return [(r.output_ids, r.accept_lengths) for r in reqs]


@pytest.fixture(scope="module")
def single_speculative():
    return speculative_outputs(build("tiny", draft="tiny"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {kind: make_checkpoint(kind, root / kind, tie=kind == "qwen3_5") for kind in KINDS}


@pytest.fixture(scope="module")
def single(checkpoints):
    return {kind: outputs(build(path)) for kind, path in checkpoints.items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_model_matches_single_process(checkpoints, single, single_speculative,
                                              world_size, record_metric):
    with LocalGroup(world_size, timeout_s=120) as tp:
        # DFLASH: the draft on rank 0, the verify and commit on every rank
        assert speculative_outputs(build("tiny", tp, draft="tiny")) == single_speculative
        for kind, path in checkpoints.items():
            for expert_parallel in (False, True) if kind in MOE_KINDS else (False,):
                logits, tokens, logprobs = outputs(build(path, tp,
                                                         expert_parallel=expert_parallel))
                want_logits, want_tokens, want_logprobs = single[kind]
                case = f"{kind}{' expert-parallel' if expert_parallel else ''}"
                assert tokens == want_tokens, case
                for got, want in zip(logits, want_logits):
                    # only the sums of the all-reduces differ in order: fp32 rounding
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                record_metric(f"{case} max |logit diff|",
                              max((g - w).abs().max().item()
                                  for g, w in zip(logits, want_logits)))
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                           rtol=1e-5, atol=1e-5)
