"""Log-probabilities from the engine are log_softmax of the model's raw logits at each output
position: against transformers, with chunked prefill, sampling, overlap scheduling (a request
without them running first) and DFLASH steps that accept drafts."""

from __future__ import annotations

import pytest
import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine, make_pools
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.load import load_model
from common.sampling import SamplingParams
from tests.common.model.checkpoints import load_hf_model, make_checkpoint

CACHE = CacheConfig(page_size=4, num_pages=300, num_slots=12)
PROMPTS = [[3, 17, 250, 9, 41, 77, 5, 128, 64, 200, 11], [7, 8, 9], [100, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny")
    return model, load_draft("tiny", model)


def raw_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: log_softmax of our model's logits before each output token, from one
    plain forward over the whole sequence."""
    device = model.get_input_embeddings().weight.device
    kv_pool, state_pool = make_pools(model, CacheConfig(page_size=4, num_pages=64,
                                                        num_slots=2), device)
    ids = prompt + output[:-1]
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=[ids], prefix_lens=[0],
                               page_ids=[kv_pool.allocator.allocate(kv_pool.pages_for(len(ids)))],
                               page_size=4, state_slots=[state_pool.allocate()],
                               return_all_logits=True, device=device)
    logits = model(batch, kv_pool=kv_pool, state_pool=state_pool).logits
    return torch.log_softmax(logits[len(prompt) - 1:].double(), dim=-1).cpu()


def assert_logprobs(req, reference: torch.Tensor, num_top: int, atol: float = 1e-4) -> None:
    assert len(req.logprobs) == len(req.output_ids) == reference.shape[0]
    for j, (token, lp) in enumerate(zip(req.output_ids, req.logprobs)):
        assert abs(lp.logprob - reference[j, token].item()) <= atol, j
        want = reference[j].topk(num_top)
        assert [t for t, _ in lp.top] == want.indices.tolist(), j
        assert torch.allclose(torch.tensor([v for _, v in lp.top], dtype=torch.float64),
                              want.values, atol=atol), j


def test_logprobs_equal_log_softmax_of_transformers_logits(tmp_path):
    path = make_checkpoint("qwen3_5_text", tmp_path / "ckpt", seed=4)
    hf = load_hf_model("qwen3_5_text", path)
    engine = LLMEngine(load_model(str(path)), EngineConfig(
        cache=CACHE, scheduler=SchedulerConfig(max_prefill_tokens=4)))  # prompts in chunks
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=5)
    # sampled at a temperature: what is reported is still the raw distribution
    sampled = SamplingParams(temperature=1.7, top_k=40, seed=3, max_new_tokens=8,
                             ignore_eos=True, logprobs=5)
    reqs = engine.generate(PROMPTS[:2], [greedy, sampled])
    for req in reqs:
        with torch.no_grad():
            ids = torch.tensor([req.prompt_ids + req.output_ids[:-1]])
            logits = hf(ids).logits[0, len(req.prompt_ids) - 1:].double()
        assert_logprobs(req, torch.log_softmax(logits, dim=-1), 5)
    assert reqs[0].logprobs[0].top[0][0] == reqs[0].output_ids[0]  # greedy: the argmax


def test_overlapped_steps_report_logprobs_for_requests_that_ask(tiny):
    model, _ = tiny
    engine = LLMEngine(model, EngineConfig(
        cache=CACHE, scheduler=SchedulerConfig(max_running_requests=8),
        cuda_graph=CudaGraphConfig(capture=False), overlap_schedule=True))
    assert engine.overlap is not None
    launched = []
    launch = engine.overlap.launch
    engine.overlap.launch = lambda reqs, sample: (
        launched.append({r.request_id for r in reqs}), launch(reqs, sample))[1]
    plain = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=3)
    first = engine.add_request(PROMPTS[0], plain, request_id="plain")
    for _ in range(5):  # overlapped decode steps in which nobody asks for logprobs
        engine.step()
    assert launched and all(ids == {"plain"} for ids in launched)
    later = [engine.add_request(PROMPTS[1], asking, request_id="asks"),
             engine.add_request(PROMPTS[2], plain, request_id="plain-too")]
    while engine.scheduler.num_requests:
        engine.step()
    assert any("asks" in ids and "plain" in ids for ids in launched)  # mixed launches
    assert first.logprobs == [] and later[1].logprobs == []
    assert_logprobs(later[0], raw_logprobs(model, PROMPTS[1], later[0].output_ids), 3)


@pytest.mark.parametrize("proposals", ["draft", "all_accepted"])
def test_dflash_steps_report_the_targets_logprobs(tiny, proposals):
    model, draft = tiny
    greedy = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True, logprobs=4)
    sampled = SamplingParams(temperature=0.8, seed=5, max_new_tokens=14, ignore_eos=True,
                             logprobs=2)
    expected = {tuple(r.prompt_ids): r.output_ids for r in LLMEngine(
        model, EngineConfig(cache=CACHE)).generate(PROMPTS, greedy)}
    engine = LLMEngine(model, EngineConfig(cache=CACHE), draft=draft)
    if proposals == "all_accepted":
        b = engine.speculator.block_size

        def propose(requests, pages):
            return torch.tensor([(expected[tuple(r.prompt_ids)][len(r.output_ids):]
                                  + [0] * b)[:b - 1] for r in requests], dtype=torch.int64)
        engine.speculator.propose = propose
    reqs = engine.generate(PROMPTS, [greedy, greedy, sampled])
    for req in reqs[:2]:
        assert req.output_ids == expected[tuple(req.prompt_ids)]
        assert_logprobs(req, raw_logprobs(model, req.prompt_ids, req.output_ids), 4)
    assert_logprobs(reqs[2], raw_logprobs(model, reqs[2].prompt_ids, reqs[2].output_ids), 2)
    if proposals == "all_accepted":
        assert max(reqs[0].accept_lengths) == engine.speculator.block_size



@pytest.mark.gpu
@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "dflash"])
def test_graph_replay_and_overlap_on_a_gpu(with_draft):
    """The trained built-in pair on a GPU with its kernels: decode steps replayed from CUDA
    graphs and overlapped (DFLASH steps from their graphs), a request without
    log-probabilities running first, against log_softmax of one plain forward on the same GPU.
    (``pycoder``, bf16 with 128-dim heads, because FlashInfer's graph attention has no float32
    kernels: the float32 ``tiny`` decodes eagerly on a GPU.)"""
    from common.model.kernels import select_kernels

    model = load_model("pycoder", device="cuda", kernels=select_kernels("gpu"))
    draft = load_draft("pycoder", model) if with_draft else None
    engine = LLMEngine(model, EngineConfig(
        cache=CACHE, device="cuda", scheduler=SchedulerConfig(max_running_requests=8),
        cuda_graph=CudaGraphConfig(max_batch_size=8)), draft=draft)
    engine.warmup()
    assert engine.overlap is not None and engine.runner.graphs is not None
    plain = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, logprobs=4)
    first = engine.add_request(PROMPTS[0], plain)
    for _ in range(5):
        engine.step()
    later = [engine.add_request(p, asking) for p in PROMPTS[1:]]
    while engine.scheduler.num_requests:
        engine.step()
    assert first.logprobs == []
    for req in later:
        reference = raw_logprobs(model, req.prompt_ids, req.output_ids)
        assert len(req.logprobs) == len(req.output_ids)
        for j, (token, lp) in enumerate(zip(req.output_ids, req.logprobs)):
            # the decode and prefill kernels round differently in bf16, and bf16 logits of
            # magnitude 16-32 are 0.125 apart: 0.15 held for the chosen tokens and not for
            # every alternative (an H200 run). A row of another step or request is off by
            # nats, far above this bound.
            assert abs(lp.logprob - reference[j, token].item()) <= 0.15, j
            off = max(abs(reference[j, t].item() - v) for t, v in lp.top)
            assert off <= 0.5, (j, off)
