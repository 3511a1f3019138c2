"""DFLASH is lossless through router -> prefill -> decode, whatever the draft proposes.

The prefill worker and the router run as processes; the decode service runs in this process so
its draft can be swapped for oracles: one that proposes the target's own greedy continuation
(everything accepted) and ones right for exactly j tokens then wrong, for every j in 0..B-1.
Output must equal plain greedy decoding token for token: this is what proves the GDN rollback.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from common.auth import new_secret
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.model.dflash import load_draft
from common.model.load import load_model, weights_identity
from common.pb.flashsplit.v1 import decode_pb2_grpc
from common.sampling import SamplingParams
from common.security import TOKEN_ENV
from decode_service.server import build_decode_service
from router.remote import generate, request_to_pb
from tests.common.engine.test_engine_logprobs import raw_logprobs
from tests.common.model.checkpoints import make_checkpoint
from tests.common.model.draft_checkpoints import make_draft_checkpoint

PAGE = 4
BLOCK = 5
NEW = 20
ROOT = Path(__file__).resolve().parents[2]
# with log-probabilities: those of drafted tokens a step accepted are checked too
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True, logprobs=2)
PROMPTS = [[11, 12, 13], [200, 3, 9, 9, 41, 77, 5, 128, 64, 1, 2], [7] * 6]


class Oracle:
    """Proposals from the known greedy continuation: the first ``j`` right, the rest wrong.

    mode "real" keeps the draft model's own proposals; "all" sets j = B-1; "cycle" walks j
    through 0..B-1 from step to step, offset per request.
    """

    def __init__(self, speculator, expected: dict[tuple[int, ...], list[int]], vocab: int):
        self.speculator, self.expected, self.vocab = speculator, expected, vocab
        self.real = speculator.propose
        self.mode, self.steps = "real", 0

    def __call__(self, requests, pages):
        if self.mode == "real":
            return self.real(requests, pages)
        b = self.speculator.block_size
        rows = []
        for r in requests:
            truth = self.expected[tuple(r.prompt_ids)][len(r.output_ids):]
            truth = (truth + [0] * b)[:b - 1]
            j = b - 1 if self.mode == "all" else (self.steps + r.prompt_ids[0]) % b
            rows.append([t if i < j else (t + 1) % self.vocab for i, t in enumerate(truth)])
        self.steps += 1
        return torch.tensor(rows, dtype=torch.int64)


def start(module: str, *args: str, token: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT,
                            env={**os.environ, TOKEN_ENV: token},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"{module} did not start: {line!r}")
    return proc, line.split()[-1]


async def serve_decode(model_path: str, draft_path: str):
    model = load_model(model_path)
    draft = load_draft(draft_path, model)
    config = EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=256, num_slots=16))
    llm = LLMEngine(model, config, draft=draft)
    service = build_decode_service(
        llm, LayoutDescriptor.from_model(model.config, PAGE, model.dtype),
        model_fingerprint(model.config, weights_identity(model_path)), max_handoff_bytes=1 << 30)
    await service.server.start()
    return service, llm


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_speculative_greedy_equals_plain_greedy_through_the_router(tmp_path, kind):
    target_path = str(make_checkpoint(kind, tmp_path / "target", seed=5))
    target = load_model(target_path)
    draft_path = str(make_draft_checkpoint(
        tmp_path / "draft", target.config, block_size=BLOCK, mask_token_id=255,
        target_layer_ids=[1, 2], seed=7))
    plain = LLMEngine(target, EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=256)))
    expected = {tuple(p): r.output_ids for p, r in zip(PROMPTS, plain.generate(PROMPTS, GREEDY))}

    async def scenario():
        service, llm = await serve_decode(target_path, draft_path)
        decode_address = service.address
        oracle = Oracle(llm.speculator, expected, target.config.vocab_size)
        llm.speculator.propose = oracle
        procs = []
        token = new_secret()  # the in-process decode service is open; the processes need one
        try:
            # started from a thread: this loop must keep serving decode while they come up
            prefill, prefill_address = await asyncio.to_thread(
                start, "prefill_service", "--model", target_path, "--draft", draft_path,
                "--page-size", str(PAGE), "--num-pages", "256", token=token)
            procs.append(prefill)
            router, router_address = await asyncio.to_thread(
                start, "router", "--model", target_path, "--prefill", prefill_address,
                # the decode service shares this process's GIL with its DFLASH steps: on a
                # loaded 2-core machine a load report once took over the default 1 s
                "--decode", decode_address, "--poll-timeout", "10", token=token)
            procs.append(router)
            seen = {}
            for mode in ("real", "all", "cycle"):
                oracle.mode = mode
                outs = await asyncio.gather(*[generate(
                    router_address, request_to_pb(token_ids=p, params=GREEDY), timeout_s=120)
                    for p in PROMPTS])
                for p, out in zip(PROMPTS, outs):
                    assert out.token_ids == expected[tuple(p)], (mode, p)
                    want = raw_logprobs(target, p, out.token_ids)
                    assert [lp.logprob for lp in out.logprobs] == pytest.approx(
                        want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist(),
                        abs=1e-4), (mode, p)
                    assert [[t for t, _ in lp.top] for lp in out.logprobs] == \
                        want.topk(2).indices.tolist(), (mode, p)
                    # the first token comes from prefill; every later one from a DFLASH step
                    assert sum(out.accept_lengths) >= NEW - 1 and out.accept_lengths
                seen[mode] = {n for out in outs for n in out.accept_lengths}
            assert seen["all"] == {BLOCK}  # every step accepted all B-1 drafts
            assert seen["cycle"] == set(range(1, BLOCK + 1))  # every j in 0..B-1 occurred
            from common.pb.flashsplit.v1 import generation_pb2, generation_pb2_grpc, types_pb2
            async with grpc.aio.insecure_channel(decode_address) as channel:
                load = await decode_pb2_grpc.DecodeStub(channel).GetLoad(
                    types_pb2.LoadRequest(), timeout=5)
            assert load.counters["spec_steps"] > 0
            assert load.counters["spec_committed_tokens"] >= load.counters["spec_steps"]
            async with grpc.aio.insecure_channel(router_address) as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).GetModelInfo(
                    generation_pb2.ModelInfoRequest(), timeout=5)
            assert info.speculative_available
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
            await service.stop()

    asyncio.run(scenario())
