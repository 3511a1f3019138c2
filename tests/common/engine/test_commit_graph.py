"""The greedy commit graphs' padded acceptance and commit, run eagerly on the CPU
(``CudaGraphConfig(capture=False)``): the tokens and accept lengths of the commit launched one
by one, padding rows committing one token into the scratch slot, nothing leaked."""

from __future__ import annotations

import pytest
import torch

from common.cache.state_pool import GDNStatePool
from common.engine.commit_graph import GreedyCommitGraphs
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.load import load_model
from common.sampling import SamplingParams

CACHE = CacheConfig(page_size=4, num_pages=300, num_slots=12)


@pytest.fixture(scope="module")
def pair():
    model = load_model("tiny")
    return model, load_draft("tiny", model)


def _engine(pair, graphs: CudaGraphConfig) -> LLMEngine:
    model, draft = pair
    return LLMEngine(model, EngineConfig(cache=CACHE, cuda_graph=graphs,
                                         scheduler=SchedulerConfig(max_running_requests=11)),
                     draft=draft)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, 250, (int(torch.randint(2, 15, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


def test_commit_graphs_give_the_tokens_of_the_commit_launched_alone(pair):
    prompts = _prompts(5)
    params = [SamplingParams(temperature=0.0, max_new_tokens=7 + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]
    alone = _engine(pair, CudaGraphConfig(capture=False, commit_graphs=False))
    assert alone.speculator.commit_graphs is None
    want = alone.generate(prompts, params)
    engine = _engine(pair, CudaGraphConfig(capture=False))
    graphs = engine.speculator.commit_graphs
    sizes = []
    run = graphs.run
    graphs.run = lambda batch: (sizes.append(batch.num_requests), run(batch))[1]
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]
    assert 8 in sizes  # five requests ran padded to eight
    assert engine.state_pool.verify.pending is None  # every verify was committed
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


def test_sampled_batches_do_not_take_the_greedy_graphs(pair):
    engine = _engine(pair, CudaGraphConfig(capture=False))
    calls = []
    run = engine.speculator.commit_graphs.run
    engine.speculator.commit_graphs.run = lambda batch: (calls.append(1), run(batch))[1]
    params = [SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_new_tokens=6, ignore_eos=True)]
    out = engine.generate(_prompts(2), params)
    assert all(len(r.output_ids) == 6 for r in out)
    assert calls == []  # one sampled row: acceptance on the host for the whole batch


def _graphs(drafts, logits, slots, committed):
    pool = GDNStatePool(layer_ids=(0,), num_slots=4, conv_dim=2, conv_window=2,
                        num_value_heads=1, key_head_dim=1, value_head_dim=1,
                        conv_dtype=torch.float32)
    n, b = drafts.shape[0], drafts.shape[1] + 1
    batch = ForwardBatch.build(mode=ForwardMode.VERIFY, token_ids=[[1] * b] * n,
                               prefix_lens=[0] * n, page_ids=[[0]] * n, page_size=b,
                               state_slots=slots, device="cpu")
    graphs = GreedyCommitGraphs(
        batch_sizes=(n,), block_size=b, state_pool=pool,
        buffers=lambda bs: (drafts, logits, batch), pad=lambda bs: None,
        commit=lambda batch, lengths: (committed.append(lengths.tolist()), pool.verify.finish()),
        capture=False)
    return graphs, pool, batch


def test_padding_rows_commit_one_token_and_real_rows_their_match():
    vocab, b = 5, 4
    drafts = torch.tensor([[2, 3, 1], [4, 4, 4], [1, 1, 1], [3, 3, 3]])
    choice = torch.tensor([[2, 3, 0, 1], [4, 4, 4, 2], [1, 1, 1, 1], [0, 0, 0, 0]])
    logits = torch.nn.functional.one_hot(choice, vocab).float().view(-1, vocab)
    committed = []
    graphs, pool, batch = _graphs(drafts, logits, [3, 1, 0, 0], committed)
    pool.begin_verify(batch)
    matched, lengths = graphs.run(batch)
    assert matched.tolist() == [[2, 3, 3, 0], [0, 2, 1, 0]]
    # row 2 matched all its drafts, but it is padding (scratch slot 0): one token
    assert committed == [[3, 4, 1, 1]]
    assert lengths.tolist() == committed[0]  # what the followers of a sharded worker commit


def test_a_commit_must_follow_the_verify_of_its_batch():
    drafts = torch.zeros(2, 3, dtype=torch.int64)
    logits = torch.zeros(8, 5)
    graphs, pool, batch = _graphs(drafts, logits, [1, 2], [])
    with pytest.raises(ValueError, match="follow the verify"):
        graphs.run(batch)  # no verify recorded
    other = ForwardBatch.build(mode=ForwardMode.VERIFY, token_ids=[[1] * 4] * 2,
                               prefix_lens=[0, 0], page_ids=[[0], [0]], page_size=4,
                               state_slots=[1, 2], device="cpu")
    pool.begin_verify(other)
    with pytest.raises(ValueError, match="follow the verify"):
        graphs.run(batch)
