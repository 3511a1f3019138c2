"""VERIFY forward + commit_verified against plain EXTEND, on transformers-made checkpoints."""

from __future__ import annotations

import pytest
import torch

from common.engine.llm_engine import CacheConfig, make_pools
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.load import load_model
from common.model.verify import replay_bytes_per_request, snapshot_bytes_per_request
from tests.common.model.checkpoints import make_checkpoint

PAGE = 4
KINDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
PROMPTS = [[3, 17, 250, 9, 41, 77, 5], [128, 64, 200, 11, 99, 1, 2, 180, 33, 7, 90],
           [12, 13, 14, 15, 201]]
K = 5
BLOCKS = [[60, 61, 62, 63, 64], [7, 7, 8, 250, 1], [100, 3, 200, 9, 41]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_ckpt")
    out = {}
    for i, kind in enumerate(KINDS):
        model = load_model(str(make_checkpoint(kind, root / kind, seed=10 + i)))
        model.set_dflash_layers_to_capture([0, 3])
        out[kind] = model
    return out


class Session:
    """Fresh pools with each prompt prefilled (one EXTEND batch); pages cover prompt + K + 1."""

    def __init__(self, model, prompts):
        self.model = model
        self.kv, self.state = make_pools(model, CacheConfig(page_size=PAGE, num_pages=64,
                                                            num_slots=8), "cpu")
        self.prompts = prompts
        self.pages = [self.kv.allocator.allocate(self.kv.pages_for(len(p) + K + 1))
                      for p in prompts]
        self.slots = [self.state.allocate() for _ in prompts]
        self.run(ForwardMode.EXTEND, prompts, [0] * len(prompts))

    def run(self, mode, tokens, prefix_lens, return_all_logits=True):
        batch = ForwardBatch.build(mode=mode, token_ids=tokens, prefix_lens=prefix_lens,
                                   page_ids=self.pages, page_size=PAGE, state_slots=self.slots,
                                   return_all_logits=return_all_logits)
        return batch, self.model(batch, kv_pool=self.kv, state_pool=self.state)


def extend_state(model, tokens):
    s = Session(model, [tokens])
    return s.state.conv[:, s.slots[0]].clone(), s.state.ssm[:, s.slots[0]].clone()


def last_logits(model, tokens):
    kv, state = make_pools(model, CacheConfig(page_size=PAGE, num_pages=64, num_slots=4), "cpu")
    batch = ForwardBatch.build(mode=ForwardMode.EXTEND, token_ids=[tokens], prefix_lens=[0],
                               page_ids=[kv.allocator.allocate(kv.pages_for(len(tokens)))],
                               page_size=PAGE, state_slots=[state.allocate()])
    return model(batch, kv_pool=kv, state_pool=state).logits[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_verify_matches_extend_and_keeps_state(models, kind):
    model = models[kind]
    s = Session(model, PROMPTS)
    conv0, ssm0 = s.state.conv.clone(), s.state.ssm.clone()
    prefix = [len(p) for p in PROMPTS]
    vbatch, vout = s.run(ForwardMode.VERIFY, BLOCKS, prefix, return_all_logits=False)
    assert vout.logits.shape == (len(PROMPTS) * K, model.config.vocab_size)
    assert vout.aux_hidden_states.shape == (len(PROMPTS) * K, 2 * model.config.hidden_size)
    # the committed state is only read
    assert torch.equal(s.state.conv, conv0) and torch.equal(s.state.ssm, ssm0)

    e = Session(model, PROMPTS)
    _, eout = e.run(ForwardMode.EXTEND, BLOCKS, prefix)
    assert rel_err(vout.logits, eout.logits) <= 1e-5
    assert rel_err(vout.aux_hidden_states, eout.aux_hidden_states) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rnd", range(K))
def test_commit_equals_extend_of_accepted_prefix(models, kind, rnd):
    model = models[kind]
    accepted = [(rnd + i) % K + 1 for i in range(len(PROMPTS))]  # every j for every request
    s = Session(model, PROMPTS)
    prefix = [len(p) for p in PROMPTS]
    vbatch, _ = s.run(ForwardMode.VERIFY, BLOCKS, prefix)
    model.commit_verified(vbatch, torch.tensor(accepted), state_pool=s.state)

    for r, (p, blk, j) in enumerate(zip(PROMPTS, BLOCKS, accepted)):
        conv, ssm = extend_state(model, p + blk[:j])
        slot = s.slots[r]
        assert torch.allclose(s.state.conv[:, slot], conv, rtol=1e-5, atol=1e-6), (r, j)
        assert torch.allclose(s.state.ssm[:, slot], ssm, rtol=1e-5, atol=1e-6), (r, j)

    # the next decode step sees exactly prompt + accepted tokens (KV past them is ignored)
    nxt = [[blk[j - 1] + 1] for blk, j in zip(BLOCKS, accepted)]
    _, dout = s.run(ForwardMode.DECODE, nxt, [len(p) + j for p, j in zip(PROMPTS, accepted)],
                    return_all_logits=False)
    for r, (p, blk, j) in enumerate(zip(PROMPTS, BLOCKS, accepted)):
        ref = last_logits(model, p + blk[:j] + nxt[r])
        assert rel_err(dout.logits[r], ref) <= 1e-5, (r, j)


@pytest.mark.parametrize("lens", [(5, 3, 4), (3, 3, 3)])
def test_commit_of_blocks_shorter_than_the_buffers(models, lens):
    """Ragged blocks (recorded through an index) and uniform blocks shorter than the buffers'
    rows (recorded through a strided copy) commit like EXTEND of the accepted prefix."""
    model = models["qwen3_5_text"]
    s = Session(model, PROMPTS)
    s.state.reserve_verify(len(PROMPTS), K)
    blocks = [blk[:n] for blk, n in zip(BLOCKS, lens)]
    accepted = [max(1, n - 1) for n in lens]
    vbatch, _ = s.run(ForwardMode.VERIFY, blocks, [len(p) for p in PROMPTS])
    model.commit_verified(vbatch, accepted, state_pool=s.state)
    for r, (p, blk, j) in enumerate(zip(PROMPTS, blocks, accepted)):
        conv, ssm = extend_state(model, p + blk[:j])
        assert torch.allclose(s.state.conv[:, s.slots[r]], conv, rtol=1e-5, atol=1e-6), (r, j)
        assert torch.allclose(s.state.ssm[:, s.slots[r]], ssm, rtol=1e-5, atol=1e-6), (r, j)


def test_commit_errors(models):
    model = models["qwen3_5_text"]
    s = Session(model, PROMPTS[:2])
    prefix = [len(p) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="no verify buffers|pending"):
        ebatch, _ = s.run(ForwardMode.EXTEND, BLOCKS[:2], prefix)
        model.commit_verified(ebatch, [1, 1], state_pool=s.state)
    s = Session(model, PROMPTS[:2])
    vbatch, _ = s.run(ForwardMode.VERIFY, BLOCKS[:2], prefix)
    other = ForwardBatch.build(mode=ForwardMode.VERIFY, token_ids=BLOCKS[:2], prefix_lens=prefix,
                               page_ids=s.pages, page_size=PAGE, state_slots=s.slots)
    with pytest.raises(ValueError, match="latest VERIFY"):
        model.commit_verified(other, [1, 1], state_pool=s.state)
    with pytest.raises(ValueError, match="outside 1..5"):
        model.commit_verified(vbatch, [0, 2], state_pool=s.state)
    with pytest.raises(ValueError, match="outside 1..5"):
        model.commit_verified(vbatch, [6, 2], state_pool=s.state)
    with pytest.raises(ValueError, match="2 requests"):
        model.commit_verified(vbatch, [1], state_pool=s.state)
    model.commit_verified(vbatch, [5, 2], state_pool=s.state)
    with pytest.raises(ValueError, match="pending"):  # a commit consumes the verify
        model.commit_verified(vbatch, [5, 2], state_pool=s.state)


def test_verify_buffers_grow_and_report_size(models):
    model = models["qwen3_5_text"]
    s = Session(model, PROMPTS)
    s.state.reserve_verify(1, 2)
    s.run(ForwardMode.VERIFY, BLOCKS, [len(p) for p in PROMPTS])  # 3 x 5 does not fit: grows
    v = s.state.verify
    assert (v.rows, v.tokens) == (3, 5)
    c = model.config
    per_row = len(c.linear_attention_layers) * K * (c.conv_dim + 2 * c.linear_num_value_heads) * 4
    assert s.state.verify_bytes_per_row(K) == per_row
    assert v.qkv.numel() * 4 + v.a.numel() * 4 * 2 == 3 * per_row


def test_memory_formulas_at_qwen3_5_4b_shapes():
    """The numbers quoted in docs/speculative.md."""
    shapes = dict(num_gdn_layers=24, num_value_heads=32, key_head_dim=128, value_head_dim=128,
                  conv_dim=8192, conv_width=4, block=16, io_bytes=2, state_bytes=4)
    assert snapshot_bytes_per_request(**shapes) == 824_180_736
    assert snapshot_bytes_per_request(**shapes, dedup_conv=True) == 812_384_256
    assert replay_bytes_per_request(**shapes) == 6_340_608
