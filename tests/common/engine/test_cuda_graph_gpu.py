"""On the GPU: decode and DFLASH steps replayed from CUDA graphs give the eager engine's tokens,
for a Qwen3.5-4B-shaped model with random bf16 weights, with batches that need padding; steps
launched ahead of the read, with the shipped trained pair (whose accept lengths vary)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode import build, kernels_of
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.sampling import SamplingParams
from tests.common.engine.ahead_runs import code_prompts, count_calls, trained_pair

pytestmark = pytest.mark.gpu

LENGTHS = (3, 17, 64, 200, 333)


@pytest.fixture(scope="module")
def models():
    return build("gpu", with_draft=True)


def _engine(model, draft, graphs: bool, capture: bool = True,
            overlap: bool = False, draft_ahead: bool = False,
            verify_ahead: bool = False) -> LLMEngine:
    """graphs=False: the plain eager engine; capture=False: the graph path's buffers, padding
    and kernels, run eagerly (what a replay must reproduce exactly)."""
    config = EngineConfig(cache=CacheConfig(page_size=16, num_pages=700, num_slots=12),
                          scheduler=SchedulerConfig(max_running_requests=10), device="cuda",
                          cuda_graph=CudaGraphConfig(enabled=graphs, max_batch_size=16,
                                                     capture=capture, draft_ahead=draft_ahead,
                                                     verify_ahead=verify_ahead),
                          overlap_schedule=overlap)
    engine = LLMEngine(model, config, draft=draft)
    if graphs:
        engine.warmup()
    return engine


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 240000, (n,), generator=gen).tolist() for n in LENGTHS]


def _count_runs(runner) -> list[int]:
    sizes = []
    run = runner.run
    runner.run = lambda reqs, toks, **kw: (sizes.append(runner.padded_size(len(reqs))),
                                           run(reqs, toks, **kw))[1]
    return sizes


def test_decode_replay_gives_the_plain_eager_tokens(models):
    model, _ = models
    params = [SamplingParams(temperature=0.0, max_new_tokens=12 + 5 * i, ignore_eos=True)
              for i in range(len(LENGTHS))]
    want = _engine(model, None, graphs=False).generate(_prompts(), params)
    got = _engine(model, None, graphs=True).generate(_prompts(), params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_pdl_launches_give_the_tokens_of_plain_launches(models):
    """The ``gpu`` set launches the GEMV, norm, SwiGLU and gate kernels as programmatic dependent
    launches; they compute the same bits as ``gpu-no-pdl``'s plain launches, so replayed decode
    steps give the same tokens."""
    from common.model.kernels import Kernels
    from common.ops.gpu_backends import backends_for

    model, _ = models
    assert dict(model.kernels.backends)["linear"] == "triton-pdl"
    params = [SamplingParams(temperature=0.0, max_new_tokens=10 + 3 * i, ignore_eos=True)
              for i in range(len(LENGTHS))]
    got = _engine(model, None, graphs=True).generate(_prompts(), params)
    with kernels_of(model, Kernels.select(backends_for("gpu-no-pdl"))):
        want = _engine(model, None, graphs=True).generate(_prompts(), params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


# two bf16 steps of a logit between 8 and 16, in log-probability
NEAR_TIE = 0.125


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def test_overlap_scheduling_gives_the_tokens_of_steps_in_turn(models):
    """Replayed steps launched while the host prepares the next (the relay feeding each step
    the previous step's tokens on the device), greedy and seeded sampled requests, requests
    finishing at different steps: the tokens of the same graphs run one step at a time, and
    the pools back to full.

    An overlapped request that finished is still in the step launched before its end was
    read, so from the first finish on overlapped steps carry one row more than the same step
    run in turn (measured: 5, 5, 4 ... against 5, 4, 4 ...) and pad to another captured size,
    whose kernels round the same row's bf16 logits differently. With random weights a near-tie
    may then go the other way (seen on the H200: the last request's 23rd token, once the GDN
    prefill ran on fla instead of FlashInfer). So a greedy request may part from the steps in
    turn only where their two best tokens were within NEAR_TIE of each other; wrong inputs
    (a stale id, a shifted position or slot) part requests at once and by far more."""
    model, _ = models
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                             max_new_tokens=9 + 4 * i, ignore_eos=True,
                             logprobs=2 if i % 2 == 0 else None)
              for i in range(len(LENGTHS))]
    want = _engine(model, None, graphs=True).generate(_prompts(), params)
    engine = _engine(model, None, graphs=True, overlap=True)
    assert engine.overlap is not None
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got = engine.generate(_prompts(), params)
    for w, g, p in zip(want, got, params):
        j = _first_difference(w.output_ids, g.output_ids)
        if j is None:
            continue
        assert p.is_greedy and len(w.output_ids) == len(g.output_ids), (w.output_ids,
                                                                        g.output_ids)
        assert j > 0, "the first token comes from the prefill, which does not overlap"
        top = dict(w.logprobs[j].top)
        assert g.output_ids[j] in top and abs(top[w.output_ids[j]] - top[g.output_ids[j]]) \
            <= NEAR_TIE, (j, w.logprobs[j], g.output_ids[j])
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "dflash"])
def test_replay_gives_eager_tokens(models, speculative):
    model, draft = models
    draft = draft if speculative else None
    params = [SamplingParams(temperature=0.0, max_new_tokens=12 + 5 * i, ignore_eos=True)
              for i in range(len(LENGTHS))]
    # The same kernels run eagerly: a replay must give exactly their tokens. (The plain eager
    # engine verifies with FlashInfer's prefill kernel instead of the graph's decode kernel, so
    # its bf16 logits differ in the last bits and a near-tie may go the other way.)
    want = _engine(model, draft, graphs=True, capture=False).generate(_prompts(), params)
    engine = _engine(model, draft, graphs=True)
    runner = engine.speculator.verify_graphs if speculative else engine.runner.graphs
    assert runner.captured
    sizes = _count_runs(runner)
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got = engine.generate(_prompts(), params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert 8 in sizes  # five requests ran padded to eight
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free
    if speculative:
        assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]


@pytest.fixture(scope="module")
def trained():
    """The shipped trained pair (bf16): its blocks are accepted to different lengths. Loaded with
    the Triton set, which needs no FlashInfer; each test picks the kernels it runs."""
    from common.model.kernels import select_kernels

    return trained_pair(device="cuda", kernels=select_kernels("gpu-triton-attention"))


@pytest.mark.parametrize("kernels,runner,ahead", [
    ("gpu", "draft_graphs", dict(draft_ahead=True)),
    ("gpu-triton-attention", "draft_graphs", dict(draft_ahead=True)),
    ("gpu-triton-attention", "verify_graphs", dict(verify_ahead=True)),
], ids=["draft", "draft-triton", "step-triton"])
def test_steps_launched_ahead_give_the_tokens_of_steps_after_the_read(trained, kernels, runner,
                                                                       ahead):
    """Replayed DFLASH steps whose draft graph (and verify graph: ``verify_ahead``, positions,
    KV slots and attention lengths moved on the device) is launched behind the previous
    step's commit graph, before the host reads it: the tokens and accept lengths of steps
    launched after the read, launched ahead in most steps."""
    from common.model.kernels import select_kernels

    try:
        chosen = select_kernels(kernels)
    except ValueError as exc:  # FlashInfer absent or unable to load on this machine
        pytest.skip(str(exc))
    model, draft = trained
    prompts = code_prompts()
    params = [SamplingParams(temperature=0.0, max_new_tokens=60 + 7 * i, ignore_eos=True)
              for i in range(len(prompts))]
    with kernels_of(model, chosen):
        want = _engine(model, draft, graphs=True).generate(prompts, params)
        engine = _engine(model, draft, graphs=True, **ahead)
        runs = count_calls(getattr(engine.speculator, runner), "run", "run_next")
        free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
        got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]
    assert max(n for r in got for n in r.accept_lengths) > 2
    assert runs["run_next"] > runs["run"]
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


def test_the_next_step_is_launched_while_the_step_before_still_runs(trained):
    """Steady-state DFLASH steps with the next verify launched ahead: the host launches the
    next step without waiting for the work queued before it (here a sleep behind each step's
    commit graph is still running when the next verify is launched), and waits on events
    only, never for the whole stream (no step raises under
    ``torch.cuda.set_sync_debug_mode("error")``). A copy of the outcome into a strided pinned
    buffer waited so in every step (2026-12-06)."""
    from common.model.kernels import Kernels
    from common.ops.gpu_backends import backends_for

    model, draft = trained
    with kernels_of(model, Kernels.select(backends_for("gpu-triton-attention"))):
        engine = _engine(model, draft, graphs=True, verify_ahead=True)
        spec = engine.speculator
        busy_at_launch = []
        commit, run_next = spec.commit_graphs.run, spec.verify_graphs.run_next

        def slow_commit(*args, **kwargs):
            out = commit(*args, **kwargs)
            torch.cuda._sleep(20_000_000)  # milliseconds of device work behind the commit
            return out

        def watched_run_next(*args, **kwargs):
            busy_at_launch.append(not torch.cuda.current_stream().query())
            return run_next(*args, **kwargs)

        spec.commit_graphs.run, spec.verify_graphs.run_next = slow_commit, watched_run_next
        engine.add_request(code_prompts(0, 1)[0],
                           SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True))
        for _ in range(3):  # prefill, then steps until one launched ahead is taken
            engine.step()
        launched = len(busy_at_launch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(6):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert busy_at_launch[launched:] == [True] * 6 and engine.has_work()
        while engine.scheduler.num_requests:
            engine.step()


def test_a_decode_engine_with_a_draft_goes_ahead_by_default():
    """What a decode worker with a draft builds from its defaults (``--kernels auto``,
    ``--speculative-ahead auto``): the Triton attention, whose plans let the whole next step
    go ahead; its tokens and accept lengths those of the same engine stepping after the
    read, pools whole after."""
    from common.engine.factory import EngineSettings, build_engine

    prompts = code_prompts()
    params = [SamplingParams(temperature=0.0, max_new_tokens=50 + 9 * i, ignore_eos=True)
              for i in range(len(prompts))]
    engines = {}
    for ahead in (False, True):
        config = EngineConfig(device="cuda", cuda_graph=CudaGraphConfig(
            max_batch_size=16, step_ahead_if_planned=ahead))
        engines[ahead] = build_engine(EngineSettings(
            model="pycoder", draft="pycoder", kernels="auto", engine=config)).engine
    engine = engines[True]
    assert dict(engine.model.kernels.backends)["paged_attention"] == "triton"
    assert engine.speculator.verify_ahead and not engines[False].speculator.verify_ahead
    want = engines[False].generate(prompts, params)
    runs = count_calls(engine.speculator.verify_graphs, "run", "run_next")
    free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]
    assert runs["run_next"] > runs["run"]
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "dflash"])
def test_triton_attention_replays_give_its_eager_tokens(models, speculative):
    """The ``gpu-triton-attention`` set: decode and verify graphs whose attention plans are
    buffer updates (no host schedule) replay the tokens of the same plans run uncaptured."""
    from common.model.kernels import Kernels
    from common.ops.gpu_backends import backends_for

    model, draft = models
    draft = draft if speculative else None
    params = [SamplingParams(temperature=0.0, max_new_tokens=12 + 5 * i, ignore_eos=True)
              for i in range(len(LENGTHS))]
    with kernels_of(model, Kernels.select(backends_for("gpu-triton-attention"))):
        want = _engine(model, draft, graphs=True, capture=False).generate(_prompts(), params)
        engine = _engine(model, draft, graphs=True)
        runner = engine.speculator.verify_graphs if speculative else engine.runner.graphs
        assert runner.captured and type(runner.attention[1]).__name__ == "TritonGraphAttention"
        free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
        got = engine.generate(_prompts(), params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free


def test_replay_logits_match_eager(models, record_metric):
    model, _ = models
    engines = [_engine(model, None, graphs=g) for g in (False, True)]
    logits = []
    for engine in engines:
        reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=4))
                for p in _prompts()]
        while any(r.is_prefilling for r in reqs):
            engine.step()
        step = engine.scheduler.schedule()
        out, _ = engine.runner.run(step)
        logits.append(out.logits.float().clone())
    diff = (logits[0] - logits[1]).abs().max().item()
    scale = logits[0].abs().max().item()
    record_metric("graph_vs_eager.logits_max_abs", diff)
    assert diff <= 2e-2 * scale


@pytest.fixture(scope="module")
def moe_model():
    """Qwen3.5-35B-A3B's layer shapes (256 experts, top 8), 4 layers, random bf16 weights."""
    from benchmarks.shapes import QWEN3_5_35B_A3B
    from common.model.builtin import fill_deterministic
    from common.model.family_registry import model_class_for, parse_model_config
    from common.model.kernels import select_kernels

    config = parse_model_config({**QWEN3_5_35B_A3B, "num_hidden_layers": 4})
    with torch.device("cuda"):
        model = model_class_for(config)(config, kernels=select_kernels("gpu"))
    fill_deterministic(model.named_parameters(), seed=3, device="cuda")
    return model.eval()


@pytest.mark.parametrize("backend", ["capturable", "triton"])
def test_moe_replay_gives_eager_tokens(moe_model, backend):
    """Each capturable MoE backend replays from graphs and gives the tokens of the same kernels
    run eagerly: one request (capturable: the gathered experts path; Triton: its kernels) and
    12 (capturable: the dense path, 3 * 12 * 8 > 256 experts; Triton: its kernels, 96 pairs)."""
    from common.model.kernels import Kernels
    from common.ops.gpu_backends import backends_for

    moe_model.kernels = Kernels.select({**backends_for("gpu"), "sparse_moe": backend})
    gen = torch.Generator().manual_seed(5)
    for count in (1, 12):
        prompts = [torch.randint(0, 240000, (5 + 7 * i,), generator=gen).tolist()
                   for i in range(count)]
        params = [SamplingParams(temperature=0.0, max_new_tokens=6 + i % 4, ignore_eos=True)
                  for i in range(count)]
        runs = []
        for capture in (False, True):
            config = EngineConfig(
                cache=CacheConfig(page_size=16, num_pages=400, num_slots=14),
                scheduler=SchedulerConfig(max_running_requests=12), device="cuda",
                cuda_graph=CudaGraphConfig(max_batch_size=16, capture=capture))
            engine = LLMEngine(moe_model, config)
            engine.warmup()
            assert engine.runner.graphs is not None and engine.runner.graphs.captured
            runs.append([r.output_ids for r in engine.generate(prompts, params)])
        assert runs[0] == runs[1]


def test_commit_graphs_give_the_tokens_of_the_commit_launched_alone():
    """With the built-in trained pair, whose drafts are often accepted (random drafts almost
    never are), so the captured commit replays accepted lengths above one."""
    from common.model.dflash import load_draft
    from common.model.kernels import select_kernels
    from common.model.load import load_model

    model = load_model("pycoder", device="cuda", kernels=select_kernels("gpu")).eval()
    draft = load_draft("pycoder", model)
    prompts = [list(range(5 + 7 * i, 40 + 9 * i)) for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=40 + 9 * i, ignore_eos=True)
              for i in range(len(prompts))]

    def run(commit_graphs: bool):
        config = EngineConfig(
            cache=CacheConfig(page_size=16, num_pages=200, num_slots=12),
            scheduler=SchedulerConfig(max_running_requests=10), device="cuda",
            cuda_graph=CudaGraphConfig(max_batch_size=16, commit_graphs=commit_graphs))
        engine = LLMEngine(model, config, draft=draft)
        engine.warmup()
        graphs, replays = engine.speculator.commit_graphs, []
        if graphs is not None:
            assert graphs.captured
            replay = graphs.run
            graphs.run = lambda batch: (replays.append(batch.num_requests), replay(batch))[1]
        free = (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)
        out = engine.generate(prompts, params)
        assert (engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free) == free
        return replays, out

    none, alone = run(False)
    replays, got = run(True)
    assert none == [] and 8 in replays  # five requests ran padded to eight
    assert [r.output_ids for r in got] == [r.output_ids for r in alone]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in alone]
    assert max(n for r in got for n in r.accept_lengths) > 1
