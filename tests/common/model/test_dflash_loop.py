"""A greedy DFLASH loop over the tiny target and tiny draft, built from the model-level API
(VERIFY forward, commit_verified, extend_context, propose), gives the target's own greedy
output token for token, whatever the acceptance lengths."""

from __future__ import annotations

import torch

from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine, make_pools
from common.model.dflash import DraftKVPool, load_draft
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.load import load_model
from common.sampling import SamplingParams

PAGE = 4
NEW = 40


def plain_greedy(target, prompts):
    engine = LLMEngine(target, EngineConfig(cache=CacheConfig(page_size=PAGE, num_pages=64)))
    reqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW,
                                                   ignore_eos=True))
    return [r.output_ids for r in reqs]


def speculative_greedy(target, draft, prompts, oracle=None):
    """Greedy speculative decoding of ``prompts`` together. ``oracle[r]`` (optional): the true
    continuation, used to overwrite request r's first m proposals (m cycling 0..B-1) so that
    every acceptance length occurs."""
    c = draft.config
    b, mask = c.block_size, c.mask_token_id
    target.set_dflash_layers_to_capture(c.target_layer_ids)
    kv_pool, state_pool = make_pools(target, CacheConfig(page_size=PAGE, num_pages=96,
                                                         num_slots=8), "cpu")
    draft_pool = DraftKVPool.like(kv_pool, c)
    state_pool.reserve_verify(len(prompts), b)
    embed, head = target.get_input_embeddings().weight, target.get_output_weight()
    pages = [kv_pool.allocator.allocate(kv_pool.pages_for(len(p) + NEW + b))
             for p in prompts]
    slots = [state_pool.allocate() for _ in prompts]

    # prefill: target KV/state for the prompt, first token, draft context for the prompt
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=prompts,
                               prefix_lens=[0] * len(prompts), page_ids=pages, page_size=PAGE,
                               state_slots=slots)
    out = target(batch, kv_pool=kv_pool, state_pool=state_pool)
    draft.extend_context(out.aux_hidden_states, batch.positions, batch.out_cache_loc, draft_pool)
    outputs = [[int(t)] for t in out.logits.argmax(-1)]
    starts = [len(p) for p in prompts]  # tokens in the target KV and the draft context
    accepted_seen, step = set(), 0
    while active := [r for r, o in enumerate(outputs) if len(o) < NEW]:
        width = max(len(pages[r]) for r in active)
        table = torch.tensor([pages[r] + [0] * (width - len(pages[r])) for r in active])
        blocks = torch.tensor([[outputs[r][-1]] + [mask] * (b - 1) for r in active])
        logits = draft.propose(block_ids=blocks, start_positions=[starts[r] for r in active],
                               page_table=table, pool=draft_pool, embed=embed, lm_head=head)
        blocks[:, 1:] = logits.argmax(-1)
        for row, r in enumerate(active):
            if oracle is not None and r in oracle:
                m, have = step % b, len(outputs[r])
                for i in range(1, min(m, len(oracle[r]) - have) + 1):
                    blocks[row, i] = oracle[r][have + i - 1]

        vbatch = ForwardBatch.build(mode=ForwardMode.VERIFY, token_ids=blocks.tolist(),
                                    prefix_lens=[starts[r] for r in active],
                                    page_ids=[pages[r] for r in active], page_size=PAGE,
                                    state_slots=[slots[r] for r in active])
        vout = target(vbatch, kv_pool=kv_pool, state_pool=state_pool)
        choice = vout.logits.argmax(-1).view(len(active), b)
        match = (blocks[:, 1:] == choice[:, :-1]).int().cumprod(-1).sum(-1)  # drafts accepted
        commit = (match + 1).tolist()  # block[0] + accepted drafts
        target.commit_verified(vbatch, commit, state_pool=state_pool)
        rows = torch.cat([torch.arange(j) + row * b for row, j in enumerate(commit)])
        draft.extend_context(vout.aux_hidden_states[rows], vbatch.positions[rows],
                             vbatch.out_cache_loc[rows], draft_pool)
        for row, (r, j) in enumerate(zip(active, commit)):
            outputs[r] += blocks[row, 1:j].tolist() + [int(choice[row, j - 1])]
            starts[r] += j
            accepted_seen.add(j - 1)
        step += 1
    return [o[:NEW] for o in outputs], accepted_seen


def test_speculative_greedy_equals_plain_greedy():
    target = load_model("tiny")
    draft = load_draft("tiny", target)
    prompts = [list(b"The quick brown fox"), list(b"0123456789"), list(b"abc")]
    expected = plain_greedy(target, prompts)
    got, _ = speculative_greedy(target, draft, prompts)
    assert got == expected
    got, seen = speculative_greedy(target, draft, prompts, oracle={0: expected[0],
                                                                   2: expected[2]})
    assert got == expected
    assert seen >= set(range(draft.config.block_size - 1)), seen  # every acceptance length
