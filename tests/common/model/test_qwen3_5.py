"""Our hybrid model against transformers, and its batching/chunking/decode invariants."""

from __future__ import annotations

import pytest
import torch

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine, make_pools
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.kernels import select_kernels
from common.model.load import load_model
from common.model.family_registry import families
from common.sampling import SamplingParams
from tests.common.model.checkpoints import KINDS, load_hf_model, make_checkpoint

PAGE = 4
PROMPT = [3, 17, 250, 9, 41, 77, 5, 128, 64, 200, 11, 99, 1, 2, 180]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: make_checkpoint(kind, root / kind, seed=i) for i, kind in enumerate(KINDS)}


def forward_all_logits(model, prompts, prefix_lens=None, pools=None):
    """One EXTEND forward of ``prompts`` (fresh slots and pages); logits of every token."""
    kv_pool, state_pool = pools or make_pools(model, CacheConfig(page_size=PAGE, num_pages=64,
                                                                  num_slots=8), "cpu")
    pages, slots = [], []
    for p in prompts:
        pages.append(kv_pool.allocator.allocate(kv_pool.pages_for(len(p))))
        slots.append(state_pool.allocate())
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=prompts,
                               prefix_lens=[0] * len(prompts), page_ids=pages, page_size=PAGE,
                               state_slots=slots, return_all_logits=True)
    return model(batch, kv_pool=kv_pool, state_pool=state_pool).logits


def hf_greedy(hf, prompt, n):
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False)
    return out[0, len(prompt):].tolist()


# the CPU kernel set (what `auto` runs on a CPU) is held to the same oracle
@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_match_transformers(checkpoints, kind, kernels):
    path = checkpoints[kind]
    hf = load_hf_model(kind, path)
    ours = load_model(str(path), kernels=select_kernels(kernels))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    got = forward_all_logits(ours, [PROMPT])
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-4

    expected = hf_greedy(hf, PROMPT, 32)
    engine = LLMEngine(ours, EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=64)))
    (req,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=32,
                                                      ignore_eos=True))
    assert req.output_ids == expected


@pytest.fixture(scope="module")
def moe_model(checkpoints):
    return load_model(str(checkpoints["qwen3_5_moe_text"]))


@pytest.fixture(scope="module")
def dense_model(checkpoints):
    return load_model(str(checkpoints["qwen3_5_text"]))


@pytest.mark.parametrize("which", ["dense_model", "moe_model"])
def test_packed_batch_equals_each_alone(request, which):
    model = request.getfixturevalue(which)
    prompts = [PROMPT[:7], PROMPT, PROMPT[3:4], PROMPT[2:11]]
    together = forward_all_logits(model, prompts)
    alone = torch.cat([forward_all_logits(model, [p]) for p in prompts])
    assert rel_err(together, alone) <= 1e-5


def test_chunked_prefill_equals_one_chunk(dense_model):
    model = dense_model
    prompt = PROMPT + [7, 8, 9, 10, 200, 201]  # 21 tokens
    cache = CacheConfig(page_size=PAGE, num_pages=32, num_slots=4)
    one_kv, one_state = make_pools(model, cache, "cpu")
    full = forward_all_logits(model, [prompt], pools=(one_kv, one_state))

    kv_pool, state_pool = make_pools(model, cache, "cpu")
    pages = kv_pool.allocator.allocate(kv_pool.pages_for(len(prompt)))
    slot = state_pool.allocate()
    logits, start = [], 0
    for size in (5, 9, 7):  # odd chunk sizes that cross page boundaries
        chunk = prompt[start:start + size]
        batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=[chunk],
                                   prefix_lens=[start],
                                   page_ids=[pages[:kv_pool.pages_for(start + size)]],
                                   page_size=PAGE, state_slots=[slot], return_all_logits=True)
        logits.append(model(batch, kv_pool=kv_pool, state_pool=state_pool).logits)
        start += size
    assert rel_err(torch.cat(logits), full) <= 1e-5
    # the state after three chunks equals the state after one pass
    assert torch.allclose(state_pool.ssm[:, slot], one_state.ssm[:, 1], rtol=1e-5, atol=1e-6)
    assert torch.allclose(state_pool.conv[:, slot], one_state.conv[:, 1], rtol=1e-6, atol=1e-7)
    n = len(prompt)
    k_one = one_kv.kv[:, 1:1 + kv_pool.pages_for(n)].flatten(2, 3)[:, :, :, :n]
    k_chunked = kv_pool.kv[:, pages].flatten(2, 3)[:, :, :, :n]
    assert torch.allclose(k_chunked, k_one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["dense_model", "moe_model"])
def test_prefill_then_decode_equals_one_forward(request, which):
    model = request.getfixturevalue(which)
    prompt, continuation = PROMPT[:9], [44, 45, 46, 250, 251, 3]
    full = forward_all_logits(model, [prompt + continuation])

    kv_pool, state_pool = make_pools(model, CacheConfig(page_size=PAGE, num_pages=32,
                                                        num_slots=4), "cpu")
    total = len(prompt) + len(continuation)
    pages = kv_pool.allocator.allocate(kv_pool.pages_for(total))
    slot = state_pool.allocate()
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=[prompt], prefix_lens=[0],
                               page_ids=[pages], page_size=PAGE, state_slots=[slot],
                               return_all_logits=True)
    logits = [model(batch, kv_pool=kv_pool, state_pool=state_pool).logits]
    for i, tok in enumerate(continuation):
        batch = ForwardBatch.build(mode=ForwardMode.DECODE, token_ids=[[tok]],
                                   prefix_lens=[len(prompt) + i], page_ids=[pages],
                                   page_size=PAGE, state_slots=[slot])
        logits.append(model(batch, kv_pool=kv_pool, state_pool=state_pool).logits)
    assert rel_err(torch.cat(logits), full) <= 1e-5


def test_batched_decode_with_chunked_engine_matches_single(dense_model):
    """Continuous batching with a small prefill budget gives each request its solo output."""
    prompts = [PROMPT[:3], PROMPT, PROMPT[5:13], PROMPT[1:2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    small = EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=64),
                         scheduler=__import__("common.engine.scheduler", fromlist=["x"])
                         .SchedulerConfig(max_prefill_tokens=6))
    batched = LLMEngine(dense_model, small).generate(prompts, params)
    for p, req in zip(prompts, batched):
        (solo,) = LLMEngine(dense_model, EngineConfig(
            cache=CacheConfig(page_size=PAGE, num_pages=64))).generate([p], params)
        assert req.output_ids == solo.output_ids


@pytest.mark.parametrize("family", families(), ids=lambda f: f.text_model_type)
def test_every_wrapper_exposes_the_capture_hook(family, checkpoints):
    cls = family.wrapper
    model = load_model(str(checkpoints[family.text_model_type]))
    assert type(model) is cls
    assert callable(getattr(cls, "set_dflash_layers_to_capture", None))
    with pytest.raises(ValueError, match="None"):
        model.set_dflash_layers_to_capture(None)
    with pytest.raises(ValueError, match="outside"):
        model.set_dflash_layers_to_capture([99])
    model.set_dflash_layers_to_capture([0, 2])
    assert model.model.capture_layer_ids == (0, 2)  # delegated to the body
    hidden = model.config.hidden_size
    out = forward_model_with_aux(model, PROMPT[:6])
    assert out.aux_hidden_states.shape == (6, 2 * hidden)
    # layer 2's output differs from layer 0's: the concatenation keeps the given order
    assert not torch.allclose(out.aux_hidden_states[:, :hidden], out.aux_hidden_states[:, hidden:])


def forward_model_with_aux(model, prompt):
    kv_pool, state_pool = make_pools(model, CacheConfig(page_size=PAGE, num_pages=16,
                                                        num_slots=2), "cpu")
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=[prompt], prefix_lens=[0],
                               page_ids=[kv_pool.allocator.allocate(kv_pool.pages_for(len(prompt)))],
                               page_size=PAGE, state_slots=[state_pool.allocate()])
    return model(batch, kv_pool=kv_pool, state_pool=state_pool)
