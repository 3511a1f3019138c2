"""The whole engine on our Triton kernels, run by Triton's interpreter on the CPU: every op with
a Triton backend uses it (FlashInfer and fla ops keep the reference), through the CUDA-graph
runners' fixed buffers and padding (uncaptured), with and without DFLASH.

This is where the kernels meet the model's real layouts: strided projection views, pool rows by
slot, padding rows on scratch slot 0, verify records, the commit. Runs where there is no CUDA
device (``tests/conftest.py`` sets TRITON_INTERPRET=1 there); the GPU end-to-end tests cover a
CUDA machine.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from common.engine.cuda_graph import CudaGraphConfig
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.kernels import Kernels
from common.model.load import load_model
from common.ops.registry import GPU_OPS
from common.sampling import SamplingParams
from tests.common.engine.interpreter_tiles import widen_tiles

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA machine runs these kernels in the GPU end-to-end tests instead")

# every op's Triton backend, and the capturable MoE op; the rest stay reference
OURS = {op: "triton" for op, backends in GPU_OPS.items() if "triton" in backends}
CACHE = CacheConfig(page_size=4, num_pages=300, num_slots=10)


def engine(kernels: dict, *, draft: bool, graphs: bool) -> LLMEngine:
    model = load_model("tiny", kernels=Kernels.select(kernels))
    config = EngineConfig(
        cache=CACHE, scheduler=SchedulerConfig(max_running_requests=5),
        cuda_graph=CudaGraphConfig(capture=False) if graphs else CudaGraphConfig(enabled=False))
    return LLMEngine(model, config, draft=load_draft("tiny", model) if draft else None,
                     block_size=3 if draft else None)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, 250, (n,), generator=gen).tolist() for n in (5, 13, 2)]


# requests that end at different steps, so the padded batch shrinks 3 -> 2 -> 1; each step
# is seconds in the interpreter
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (4, 6, 3)]


@pytest.fixture(autouse=True)
def wide_tiles(monkeypatch):
    widen_tiles(monkeypatch)


def test_every_triton_op_is_in_use():
    chosen = dict(Kernels.select(OURS).backends)
    assert {op for op, b in chosen.items() if b == "triton"} >= {
        "gdn_decode_in_place", "conv1d_update_in_place", "gdn_verify", "gdn_commit_in_place",
        "qk_norm_rope_store", "sigmoid_gate_mul", "draft_block_attention", "add_rms_norm",
        "rms_norm", "gated_rms_norm", "silu_and_mul", "store_paged_kv", "linear",
        "paged_attention"}


def test_triton_kernels_give_the_reference_tokens():
    want = [r.output_ids for r in engine({}, draft=False, graphs=False).generate(prompts(), PARAMS)]
    plain = engine(OURS, draft=False, graphs=True)
    free = (plain.kv_pool.allocator.num_free, plain.state_pool.allocator.num_free)
    assert [r.output_ids for r in plain.generate(prompts(), PARAMS)] == want
    assert (plain.kv_pool.allocator.num_free, plain.state_pool.allocator.num_free) == free


def test_dflash_on_triton_kernels_is_lossless():
    # fewer tokens than above: the interpreter walks every verify block token by token
    few, params = prompts()[:2], [SamplingParams(temperature=0.0, max_new_tokens=n,
                                                 ignore_eos=True) for n in (5, 3)]
    want = [r.output_ids for r in engine({}, draft=False, graphs=False).generate(few, params)]
    spec = engine(OURS, draft=True, graphs=True)
    free = (spec.kv_pool.allocator.num_free, spec.state_pool.allocator.num_free)
    asked = [dataclasses.replace(p, speculative=True) for p in params]
    assert [r.output_ids for r in spec.generate(few, asked)] == want
    assert spec.speculator.stats["spec_steps"] > 0
    assert (spec.kv_pool.allocator.num_free, spec.state_pool.allocator.num_free) == free
