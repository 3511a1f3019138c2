"""A tensor-parallel prefill engine reports each chunk's finished KV pages, gathered from every
rank, as the chunk ends (and the GDN state after the last), equal to one process's pools."""

from __future__ import annotations

import torch

from common.engine.factory import EngineSettings, build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.engine.scheduler import SchedulerConfig
from common.parallel.launch import LocalGroup
from common.request_spec import RequestSpec
from common.sampling import SamplingParams
from prefill_service.engine import PrefillEngine, PrefillJob

PROMPT = tuple((i * 37 + 11) % 256 for i in range(23))  # 6 pages of 4, in chunks of 8 tokens
ONE = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)


def prefill(tp=None):
    """Reports of one held prefill of PROMPT, and the engine's pools and page ids."""
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=32, num_slots=3),
                          scheduler=SchedulerConfig(max_prefill_tokens=8,
                                                    reserve_output_tokens=False),
                          hold_after_prefill=True)
    built = build_engine(EngineSettings(model="tiny", engine=config,
                                        tensor_parallel_size=1 if tp is None else tp.world_size),
                         tp=tp)
    engine = PrefillEngine(built.engine, built.layout, built.fingerprint)
    engine.start()
    try:
        reports = []
        engine.submit(PrefillJob(1, RequestSpec("r", PROMPT, ONE)), reports.append).result(60)
        llm = built.engine
        req = llm.requests["1"]
        kv = llm.kv_pool.kv[:, torch.tensor(req.page_ids[:6])].clone()
        state = (llm.state_pool.conv[:, req.slot].clone(), llm.state_pool.ssm[:, req.slot].clone())
        engine.release(1).result(10)
    finally:
        engine.stop()
    return reports, kv, state


def test_each_chunk_reports_its_pages_gathered_and_the_last_the_state():
    _, kv, (conv, ssm) = prefill()
    with LocalGroup(2, timeout_s=120) as tp:
        reports, _, _ = prefill(tp)
    assert [r.num_pages for r in reports] == [2, 4, 6]  # chunks end at tokens 8, 16, 23
    assert [r.gathered_from for r in reports] == [0, 2, 4]
    assert [r.final for r in reports] == [False, False, True]
    for r in reports:  # the all-reduces sum in another order: fp32 rounding
        torch.testing.assert_close(r.gathered.kv, kv[:, r.gathered_from:r.num_pages],
                                   rtol=1e-5, atol=1e-5)
        assert r.gathered.conv.shape[1] == (1 if r.final else 0)  # the state comes last
    torch.testing.assert_close(reports[-1].gathered.conv[:, 0], conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reports[-1].gathered.ssm[:, 0], ssm, rtol=1e-5, atol=1e-5)
