"""A worker's pools from --mem-fraction on the CPU (the budget: a fraction of physical memory),
and the pool costs against the pools an engine really makes."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from common.cache.sizing import DEFAULT_NUM_PAGES, DEFAULT_NUM_SLOTS, MemoryFigures, PoolRequest
from common.engine import pool_sizing
from common.engine.factory import build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.pool_sizing import (host_figures, min_pages, pool_costs, profile_prefill,
                                       size_engine_pools, tensor_bytes)
from common.engine.scheduler import SchedulerConfig
from common.model.dflash import load_draft
from common.model.load import load_model
from common.sampling import SamplingParams
from common.worker_args import engine_settings_from_args, pool_request_from_args
from common.worker_flags import add_worker_args

MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def draft(tiny):
    return load_draft("tiny", tiny)


def engine_pool_bytes(engine: LLMEngine) -> tuple[int, int]:
    pages = engine.kv_pool.kv.nbytes
    if engine.speculator is not None:
        pages += engine.speculator.draft_pool.kv.nbytes
    return pages, engine.state_pool.conv.nbytes + engine.state_pool.ssm.nbytes


@pytest.mark.parametrize("with_draft", [False, True])
def test_costs_are_what_the_engine_pools_take(tiny, draft, with_draft):
    d = draft if with_draft else None
    costs = pool_costs(tiny, d, page_size=8)
    engine = LLMEngine(tiny, EngineConfig(cache=CacheConfig(page_size=8, num_pages=10,
                                                            num_slots=3)), draft=d)
    pages, slots = engine_pool_bytes(engine)
    assert costs.page_bytes * 10 == pages and costs.slot_bytes * 3 == slots
    page_tensors = [engine.kv_pool.kv.nbytes]
    if engine.speculator is not None:
        page_tensors.append(engine.speculator.draft_pool.kv.nbytes)
    assert costs.page_tensor_bytes * 10 == max(page_tensors)  # the larger page tensor
    assert costs.slot_tensor_bytes * 3 == max(engine.state_pool.conv.nbytes,
                                              engine.state_pool.ssm.nbytes)


def fake_host(monkeypatch, total: int, free: int | None = None) -> None:
    def figures(modules, device):
        fixed = sum(tensor_bytes(m) for m in modules if m is not None)
        return MemoryFigures(device=device, total_bytes=total, free_bytes=free, fixed_bytes=fixed)
    monkeypatch.setattr(pool_sizing, "host_figures", figures)


def test_a_fraction_of_host_memory_sizes_the_pools(tiny, draft, monkeypatch):
    fake_host(monkeypatch, total=1 << 30)
    config = EngineConfig(scheduler=SchedulerConfig(max_prefill_tokens=64,
                                                    max_running_requests=7))
    request = PoolRequest(mem_fraction=0.05, default_slots=8, min_pages=min_pages(config))
    sized, sizing = size_engine_pools(tiny, config, request, draft=draft)
    assert sized.cache.num_slots == 8 and sized.cache.num_pages == sizing.num_pages
    budget = int(0.05 * (1 << 30))
    weights = tensor_bytes(tiny) + tensor_bytes(draft)
    engine = LLMEngine(tiny, sized, draft=draft)
    used = weights + sum(engine_pool_bytes(engine))
    assert budget - pool_costs(tiny, draft, 16).page_bytes < used <= budget
    # and the engine serves with them
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4,
                                                      ignore_eos=True))
    assert out[0].finish_reason == "length"


def test_too_small_a_fraction_says_what_to_raise_it_to(tiny, monkeypatch):
    fake_host(monkeypatch, total=1 << 30)
    config = EngineConfig()
    request = PoolRequest(mem_fraction=0.001, default_slots=65, min_pages=min_pages(config))
    with pytest.raises(ValueError, match=r"Raise --mem-fraction to at least 0\.0\d\d"):
        size_engine_pools(tiny, config, request)


def test_without_a_fraction_the_fixed_sizes_stay(tiny):
    config = EngineConfig(cache=CacheConfig(num_pages=DEFAULT_NUM_PAGES,
                                            num_slots=DEFAULT_NUM_SLOTS))
    sized, sizing = size_engine_pools(tiny, config, PoolRequest())
    assert (sized.cache.num_pages, sized.cache.num_slots) == (DEFAULT_NUM_PAGES,
                                                              DEFAULT_NUM_SLOTS)
    assert sizing.budget_bytes is None


def test_host_figures_are_this_machines():
    figures = host_figures([torch.nn.Linear(4, 4)], "cpu")
    assert figures.total_bytes > figures.fixed_bytes == (16 + 4) * 4
    assert figures.free_bytes is None or 0 < figures.free_bytes <= figures.total_bytes


def test_tied_weights_are_counted_once():
    layer = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = layer.weight
    both = torch.nn.ModuleList([layer, head])
    assert tensor_bytes(both) == 10 * 4 * 4


def test_the_profile_prefill_leaves_the_pools_as_it_found_them(tiny):
    for prefill in (False, True):
        config = EngineConfig(cache=CacheConfig(page_size=8, num_pages=40, num_slots=3),
                              scheduler=SchedulerConfig(max_prefill_tokens=64),
                              hold_after_prefill=prefill)
        engine = LLMEngine(tiny, config)
        before = engine.load()
        profile_prefill(engine)
        assert engine.load() == before and not engine.requests


def worker_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return p.parse_args(["--model", "tiny", *argv])


def test_a_prefill_worker_that_shares_its_pools_budgets_for_their_copy():
    config = EngineConfig(scheduler=SchedulerConfig(max_running_requests=9))
    shared = pool_request_from_args(worker_args("--mem-fraction", "0.5"), config, prefill=True)
    assert shared.copied_at_start and shared.default_slots == 10
    streamed = pool_request_from_args(
        worker_args("--mem-fraction", "0.5", "--handoff-transport", "stream"), config,
        prefill=True)
    assert not streamed.copied_at_start
    decode = pool_request_from_args(worker_args("--mem-fraction", "0.5"), config, prefill=False)
    assert not decode.copied_at_start


def test_a_worker_built_with_mem_fraction_logs_what_it_chose(monkeypatch, caplog):
    fake_host(monkeypatch, total=4 << 30)
    args = worker_args("--mem-fraction", "0.02", "--num-slots", "5", "--no-progress")
    with caplog.at_level("INFO"):
        engine = build_engine(engine_settings_from_args(args, prefill=False)).engine
    assert engine.state_pool.num_slots == 5
    assert engine.kv_pool.num_pages > DEFAULT_NUM_PAGES  # 80 MiB holds more than the default
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("pools:"))
    assert f"{engine.kv_pool.num_pages} KV pages" in line and "5 GDN state slots" in line
    assert "--mem-fraction 0.02 of 4.00 GiB on cpu" in line and "--num-slots given" in line


def test_explicit_pages_win_over_the_fraction(monkeypatch):
    fake_host(monkeypatch, total=4 << 30)
    args = worker_args("--mem-fraction", "0.02", "--num-pages", "64", "--no-progress")
    engine = build_engine(engine_settings_from_args(args, prefill=False)).engine
    assert engine.kv_pool.num_pages == 64 and engine.state_pool.num_slots == 65


def test_a_worker_whose_pools_do_not_fit_exits_2_saying_what_to_change():
    done = subprocess.run(
        [sys.executable, "-m", "decode_service", "--model", "tiny", "--mem-fraction", "0.000001",
         "--insecure-no-auth", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: --mem-fraction 1e-06 gives" in done.stderr
    assert "Raise --mem-fraction to at least" in done.stderr and "Traceback" not in done.stderr
