"""The CUDA-graph decode path's fixed buffers and padding, run eagerly on the CPU
(``CudaGraphConfig(capture=False)``): same tokens and logits as the plain eager path, padding
rows confined to scratch page 0 and slot 0, nothing leaked."""

from __future__ import annotations

import pytest
import torch

from common.engine.cuda_graph import CudaGraphConfig, GraphRunner
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.load import load_model
from common.sampling import SamplingParams
from tests.common.engine.interpreter_tiles import widen_tiles

CACHE = CacheConfig(page_size=4, num_pages=300, num_slots=12)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def _engine(model, graphs: CudaGraphConfig) -> LLMEngine:
    return LLMEngine(model, EngineConfig(cache=CACHE, cuda_graph=graphs,
                                         scheduler=SchedulerConfig(max_running_requests=11)))


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, 250, (int(torch.randint(1, 14, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


def test_batch_sizes_cover_every_batch_up_to_the_cap():
    sizes = CudaGraphConfig(max_batch_size=256).batch_sizes(max_running=100)
    assert sizes[0] == 1 and sizes[-1] == 100 and list(sizes) == sorted(set(sizes))
    assert CudaGraphConfig(max_batch_size=3).batch_sizes(max_running=64) == (1, 2, 3)


def test_graphs_stay_off_on_cpu_unless_asked_to_run_uncaptured(model):
    assert _engine(model, CudaGraphConfig()).runner.graphs is None
    assert _engine(model, CudaGraphConfig(enabled=False, capture=False)).runner.graphs is None
    prefill = LLMEngine(model, EngineConfig(cache=CACHE, hold_after_prefill=True,
                                            cuda_graph=CudaGraphConfig(capture=False)))
    assert prefill.runner.graphs is None  # a prefill worker never decodes


def test_padded_decode_gives_the_eager_tokens_and_frees_everything(model):
    prompts = _prompts(9)
    # different lengths, so the decode batch shrinks through padded sizes 12, 8, 4, 2, 1
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    eager = _engine(model, CudaGraphConfig(enabled=False))
    want = [r.output_ids for r in eager.generate(prompts, params)]

    engine = _engine(model, CudaGraphConfig(capture=False))
    graphs = engine.runner.graphs
    seen = []
    run = graphs.run
    graphs.run = lambda reqs, toks, **kw: (seen.append(graphs.padded_size(len(reqs))),
                                           run(reqs, toks, **kw))[1]
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got = [r.output_ids for r in engine.generate(prompts, params)]
    assert got == want
    assert {1, 2, 4, 8, 11} <= set(seen)  # padded sizes actually used (11 = the cap)
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


def test_padding_rows_touch_only_scratch_page_and_slot(model):
    engine = _engine(model, CudaGraphConfig(capture=False))
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=8))
            for p in _prompts(3)]
    while any(r.is_prefilling for r in reqs):
        engine.step()
    kv_before = engine.kv_pool.kv.clone()
    ssm_before = engine.state_pool.ssm.clone()
    live_pages = sorted({p for r in reqs for p in r.page_ids})
    live_slots = sorted(r.slot for r in reqs)
    engine.step()  # 3 requests padded to 4
    kv_changed = (engine.kv_pool.kv != kv_before).flatten(2).any(-1).any(0)  # [pages]
    ssm_changed = (engine.state_pool.ssm != ssm_before).flatten(2).any(-1).any(0)  # [slots]
    assert set(kv_changed.nonzero().flatten().tolist()) <= {0, *live_pages}
    assert set(ssm_changed.nonzero().flatten().tolist()) == {0, *live_slots}


def test_graph_runner_logits_match_a_plain_forward(model):
    engine = _engine(model, CudaGraphConfig(enabled=False))
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=8))
            for p in _prompts(5)]
    while any(r.is_prefilling for r in reqs):
        engine.step()
    slot_state = engine.state_pool.ssm.clone(), engine.state_pool.conv.clone()
    tokens = [[r.output_ids[-1]] for r in reqs]
    batch = ForwardBatch.build(
        mode=ForwardMode.DECODE, token_ids=tokens, prefix_lens=[r.num_cached for r in reqs],
        page_ids=[r.page_ids for r in reqs], page_size=CACHE.page_size,
        state_slots=[r.slot for r in reqs])
    want = model(batch, kv_pool=engine.kv_pool, state_pool=engine.state_pool).logits
    engine.state_pool.ssm.copy_(slot_state[0])
    engine.state_pool.conv.copy_(slot_state[1])
    runner = GraphRunner(model, engine.kv_pool, engine.state_pool, batch_sizes=(2, 8),
                         capture=False)
    out, padded = runner.run(reqs, tokens)
    assert padded.num_requests == 8 and out.logits.shape == want.shape
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one new token"):
        GraphRunner(model, engine.kv_pool, engine.state_pool, batch_sizes=(1,),
                    q_len=2, capture=False)


def test_padded_verify_keeps_dflash_lossless(model):
    from common.model.dflash import load_draft

    draft = load_draft("tiny", model)
    prompts = _prompts(5)
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [r.output_ids for r in _engine(model, CudaGraphConfig(enabled=False))
            .generate(prompts, params)]
    eager = LLMEngine(model, EngineConfig(cache=CACHE, cuda_graph=CudaGraphConfig(enabled=False),
                                          scheduler=SchedulerConfig(max_running_requests=11)),
                      draft=draft)
    eager_out = eager.generate(prompts, params)
    engine = LLMEngine(model, EngineConfig(cache=CACHE, cuda_graph=CudaGraphConfig(capture=False),
                                           scheduler=SchedulerConfig(max_running_requests=11)),
                       draft=draft)
    verify = engine.speculator.verify_graphs
    assert verify is not None and verify.q_len == engine.speculator.block_size
    assert engine.speculator.draft_graphs is not None
    sizes = []
    run = verify.run
    verify.run = lambda reqs, toks, **kw: (sizes.append(verify.padded_size(len(reqs))),
                                           run(reqs, toks, **kw))[1]
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == want == [r.output_ids for r in eager_out]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in eager_out]
    assert 8 in sizes  # 5 requests ran padded to 8
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """One MoE checkpoint with the reference MoE op and with each capturable one."""
    from common.model.kernels import Kernels
    from tests.common.model.checkpoints import make_checkpoint

    path = make_checkpoint("qwen3_5_moe_text", tmp_path_factory.mktemp("moe") / "m", seed=4)
    return {backend: load_model(str(path), kernels=Kernels.select({"sparse_moe": backend}))
            for backend in ("reference", "capturable", "triton")}


def test_moe_graphs_need_the_capturable_op_and_stay_within_its_tokens(model, moe_models):
    from common.ops.moe.capturable import MAX_TOKENS

    config = EngineConfig(cache=CACHE, cuda_graph=CudaGraphConfig(capture=False),
                          scheduler=SchedulerConfig(max_running_requests=MAX_TOKENS + 36))
    assert LLMEngine(moe_models["reference"], config)._graph_token_cap() == 0
    assert LLMEngine(moe_models["triton"], config)._graph_token_cap() == MAX_TOKENS
    engine = LLMEngine(moe_models["capturable"], config)
    assert engine._graph_token_cap() == MAX_TOKENS
    assert engine.runner.graphs.batch_sizes[-1] == MAX_TOKENS
    assert LLMEngine(model, config)._graph_token_cap() is None  # no MoE layer, no cap


@pytest.mark.parametrize("backend", ["capturable", "triton"])
def test_moe_padded_decode_gives_the_eager_tokens(moe_models, backend, monkeypatch):
    """Each capturable MoE op (the Triton one in Triton's interpreter here, with wider tiles)
    through padded graph batches (uncaptured) gives the reference op's eager tokens."""
    widen_tiles(monkeypatch)
    prompts = _prompts(5)
    params = [SamplingParams(temperature=0.0, max_new_tokens=4 + i, ignore_eos=True)
              for i in range(len(prompts))]
    eager = LLMEngine(moe_models["reference"], EngineConfig(
        cache=CACHE, cuda_graph=CudaGraphConfig(enabled=False),
        scheduler=SchedulerConfig(max_running_requests=11)))
    want = [r.output_ids for r in eager.generate(prompts, params)]
    engine = _engine(moe_models[backend], CudaGraphConfig(capture=False))
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    assert [r.output_ids for r in engine.generate(prompts, params)] == want
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


def test_verify_graphs_respect_the_token_cap_of_the_target_ops(model):
    from common.engine.llm_engine import make_pools
    from common.engine.speculative import DFlashSpeculator
    from common.model.dflash import load_draft

    draft = load_draft("tiny", model)
    caps = {}
    for tokens in (None, 64, 3):
        kv_pool, state_pool = make_pools(model, CACHE, "cpu")
        spec = DFlashSpeculator(model, draft, kv_pool, state_pool, block_size=16,
                                max_requests=10, graphs=CudaGraphConfig(capture=False),
                                max_graph_tokens=tokens)
        caps[tokens] = None if spec.verify_graphs is None else spec.verify_graphs.batch_sizes[-1]
    assert caps == {None: 10, 64: 4, 3: None}  # 1024 // 16 > 10; 64 // 16; below one block


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_an_attention_plan_takes_this_ranks_heads(world_size):
    # a rank's queries and KV heads, not the model's: a graph of a tensor-parallel rank plans
    # attention over what its pools and projections hold
    from benchmarks.shapes import QWEN3_5_35B_A3B
    from common.cache.pools import make_pools
    from common.engine.cuda_graph import _attention_plan
    from common.model.family_registry import model_class_for, parse_model_config
    from common.parallel.group import TensorParallelGroup
    from tests.common.parallel.stand_in_group import NoOtherRank

    config = parse_model_config({**QWEN3_5_35B_A3B, "num_hidden_layers": 4, "hidden_size": 256,
                                 "num_experts": 4, "vocab_size": 512, "dtype": "float32"})
    pg = NoOtherRank()
    shard = model_class_for(config)(config, tp=TensorParallelGroup(0, world_size, pg, pg))
    kv_pool, _ = make_pools(shard, CacheConfig(page_size=16, num_pages=4, num_slots=2), "cpu")
    asked = {}
    _attention_plan(shard, kv_pool, rows=2, q_len=1, make_plan=lambda **kw: asked.update(kw))
    assert asked["num_qo_heads"] == 16 // world_size
    assert asked["num_kv_heads"] == kv_pool.kv.shape[-2] == max(1, 2 // world_size)


def test_captures_run_with_the_collector_paused_after_one_collection(monkeypatch):
    """A collection inside a capture could destroy an earlier engine's CUDA graphs, which CUDA
    does not permit while a stream captures (it invalidates the capture): garbage from before
    is collected first, and the collector stays off while the graphs are captured."""
    import contextlib
    import gc
    import weakref

    from common.engine import cuda_graph

    events = []

    class Cycle:
        pass

    gc.disable()  # the garbage stays until something collects it
    garbage = Cycle()
    garbage.self = garbage
    weakref.finalize(garbage, events.append, "collected")
    del garbage
    gc.enable()

    @contextlib.contextmanager
    def capture(graph, pool=None):
        events.append(("capture", gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", capture)
    graphs, outputs = cuda_graph.capture_graphs(
        [1, 2], prepare=lambda bs: None, forward=lambda bs: bs * 10, label="test graphs",
        progress=False)
    assert events == ["collected", ("capture", False), ("capture", False)]
    assert gc.isenabled()
    assert outputs == {1: 10, 2: 20} and set(graphs) == {1, 2}
