"""DFLASH in the engine: mixed batches, stops inside accepted blocks, and the sampled output
distribution (lossless rejection sampling), on CPU."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch

import common.engine.speculative as speculative_module
from common.engine.acceptance import Acceptance
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.engine.scheduler import SchedulerConfig
from common.model.builtin import fill_deterministic, fill_draft_deterministic
from common.model.dflash import DFlashDraftModel, load_draft
from common.model.dflash_config import DFlashConfig
from common.model.family_registry import model_class_for, parse_model_config
from common.model.load import load_model
from common.sampling import SamplingParams
from tests.common.model.draft_checkpoints import draft_config_dict

CACHE = CacheConfig(page_size=4, num_pages=400, num_slots=12)


def all_accepting(speculator, expected):
    """Replace the draft's proposals with the true greedy continuation."""
    def propose(requests, pages):
        b = speculator.block_size
        rows = [(expected[tuple(r.prompt_ids)][len(r.output_ids):] + [0] * b)[:b - 1]
                for r in requests]
        return torch.tensor(rows, dtype=torch.int64)
    speculator.propose = propose


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny")
    return model, load_draft("tiny", model)


def test_mixed_batch_and_stops_inside_accepted_blocks(tiny):
    model, draft = tiny
    prompts = [list(b"speculate"), list(b"plain one"), list(b"stop inside"), list(b"short")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    plain = LLMEngine(model, EngineConfig(cache=CACHE))
    expected = {tuple(p): r.output_ids for p, r in zip(prompts, plain.generate(prompts, greedy))}

    engine = LLMEngine(model, EngineConfig(cache=CACHE), draft=draft)
    all_accepting(engine.speculator, expected)
    b = engine.speculator.block_size
    stop_at = 3  # output index 3 lies inside the first DFLASH block (outputs 1..b)
    stop_token = expected[tuple(prompts[2])][stop_at]
    cut = expected[tuple(prompts[2])].index(stop_token)
    reqs = [
        engine.add_request(prompts[0], greedy),
        engine.add_request(prompts[1], dataclasses.replace(greedy, speculative=False)),
        engine.add_request(prompts[2], SamplingParams(temperature=0.0, max_new_tokens=30,
                                                      ignore_eos=True,
                                                      stop_token_ids=(stop_token,))),
        engine.add_request(prompts[3], SamplingParams(temperature=0.0, max_new_tokens=b // 2 + 2,
                                                      ignore_eos=True)),
    ]
    before = engine.load()
    events = []
    while engine.has_work():
        events += engine.step()
    assert reqs[0].output_ids == expected[tuple(prompts[0])]
    assert reqs[0].speculative and set(reqs[0].accept_lengths[:-1]) == {b}
    assert reqs[1].output_ids == expected[tuple(prompts[1])]
    assert not reqs[1].speculative and reqs[1].accept_lengths == []
    assert reqs[2].output_ids == expected[tuple(prompts[2])][:cut + 1]
    assert reqs[2].finish_reason == "stop"
    assert reqs[3].output_ids == expected[tuple(prompts[3])][:b // 2 + 2]
    assert reqs[3].finish_reason == "length"
    # nothing was emitted after a request finished
    per_request = collections.Counter(e.request_id for e in events)
    assert [per_request[r.request_id] for r in reqs] == [len(r.output_ids) for r in reqs]
    load = engine.load()
    assert (load["free_pages"], load["free_slots"]) == (before["total_pages"],
                                                        before["total_slots"])


def test_requests_past_the_batch_limit_decode_without_the_draft(tiny):
    """--speculative-disable-by-batch-size: a request that leaves the choice to the engine
    speculates only while fewer than the limit are there; one that asks for it gets it; the
    tokens are the plain engine's either way."""
    model, draft = tiny
    prompts = [list(b"first"), list(b"second"), list(b"third"), list(b"fourth")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    plain = LLMEngine(model, EngineConfig(cache=CACHE))
    expected = [r.output_ids for r in plain.generate(prompts, greedy)]

    engine = LLMEngine(model, EngineConfig(cache=CACHE, speculative_disable_by_batch_size=2),
                       draft=draft)
    reqs = [engine.add_request(prompts[0], greedy), engine.add_request(prompts[1], greedy),
            engine.add_request(prompts[2], greedy),
            engine.add_request(prompts[3], dataclasses.replace(greedy, speculative=True))]
    assert [r.speculative for r in reqs] == [True, True, False, True]
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in reqs] == expected
    assert reqs[2].accept_lengths == [] and reqs[0].accept_lengths
    # once the engine is empty again, a new request speculates
    assert engine.add_request(prompts[0], greedy).speculative


def test_a_prefill_engine_ignores_the_batch_limit(tiny):
    """A prefill worker decodes nothing: its load says nothing of the decode batch, so it makes
    the draft context whatever it holds."""
    model, draft = tiny
    engine = LLMEngine(model, EngineConfig(cache=CACHE, hold_after_prefill=True,
                                           speculative_disable_by_batch_size=1), draft=draft)
    engine.add_request(list(b"held"), SamplingParams(max_new_tokens=4))
    assert engine.wants_speculation(None) and not engine.wants_speculation(False)


# --- sampling: the distribution with speculation equals the distribution without it --------

SMALL_TARGET = {
    "model_type": "qwen3_5_text", "vocab_size": 6, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "linear_attention",
                                            "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
    "tie_word_embeddings": True, "dtype": "float32",
}
# the lossy rule below scores about 12x the critical value at this size, so it has power to spare
SAMPLES = 1500
SAMPLED = SamplingParams(temperature=1.3, top_k=5, max_new_tokens=4, ignore_eos=True)


def small_models():
    config = parse_model_config(dict(SMALL_TARGET))
    target = model_class_for(config)(config)
    with torch.no_grad():
        fill_deterministic(target.named_parameters(), seed=11)
        # a flatter output so that every token is plausible and rejections are frequent
        target.model.norm.weight.mul_(0.0).add_(-0.7)
    draft_cfg = draft_config_dict(config, block_size=3, mask_token_id=5,
                                  target_layer_ids=[0, 1])
    draft_cfg["head_dim"] = 8
    draft = DFlashDraftModel(DFlashConfig.from_dict(draft_cfg, target=config),
                             dtype=torch.float32)
    with torch.no_grad():
        fill_draft_deterministic(draft.named_parameters(), seed=12)
    return target.eval(), draft.eval()


def sample_continuations(target, draft, device: str = "cpu") -> collections.Counter:
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=SAMPLES * 4 + 1,
                                            num_slots=SAMPLES + 1),
                          scheduler=SchedulerConfig(max_prefill_tokens=SAMPLES * 3,
                                                    max_running_requests=SAMPLES),
                          device=device)
    engine = LLMEngine(target, config, eos_token_ids=(99,), draft=draft)
    params = [SamplingParams(**{**SAMPLED.__dict__, "seed": s}) for s in range(SAMPLES)]
    reqs = engine.generate([[1, 2, 3]] * SAMPLES, params)
    if draft is not None:
        assert all(r.accept_lengths for r in reqs)
    # outputs 1..3 come from DFLASH steps (output 0 is the prefill's sample)
    return collections.Counter(tuple(r.output_ids[1:]) for r in reqs)


def chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the outcomes seen (equal sample sizes)."""
    keys = set(a) | set(b)
    stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    return stat, len(keys) - 1


def critical_value(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.09 is p = 0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def sampled_without_speculation():
    target, _ = small_models()
    return sample_continuations(target, None)


def test_sampled_distribution_is_unchanged_by_speculation(sampled_without_speculation):
    target, draft = small_models()
    stat, df = chi_square(sample_continuations(target, draft), sampled_without_speculation)
    assert stat < critical_value(df), (stat, df)


def test_a_wrong_acceptance_rule_is_caught(sampled_without_speculation, monkeypatch):
    """The test above has the power to see a lossy rule: accepting every draft."""
    def accept_everything(drafts, logits, params, generators):
        return [Acceptance(drafts.shape[1], int(torch.multinomial(
            torch.softmax(row[-1] / p.temperature, -1), 1, generator=g)))
            for row, p, g in zip(logits, params, generators)]
    monkeypatch.setattr(speculative_module, "accept_sampled_rows", accept_everything)
    target, draft = small_models()
    stat, df = chi_square(sample_continuations(target, draft), sampled_without_speculation)
    assert stat > critical_value(df), (stat, df)
