"""Our DFLASH draft against z-lab's reference ``dflash.model.DFlashDraftModel`` (PyPI dflash 0.1.0)
with the same weights: same context hidden states, blocks and positions -> same logits."""

from __future__ import annotations

import json

import pytest
import torch

from common.model.dflash import DraftKVPool, load_draft
from common.model.load import load_model

# the oracle is installed by `make venv` (pip install --no-deps dflash==0.1.0); a missing oracle
# is an error, never a skip
import dflash.model as dflash_model  # noqa: E402

PAGE = 4
NUM_PAGES = 24
BLOCK = 8
MASK = 257  # tiny's <|mask|>

VARIANTS = {
    "full": dict(),
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                    use_sliding_window=True),
    "sliding_noncausal": dict(layer_types=["sliding_attention", "full_attention"],
                              sliding_window=6, use_sliding_window=True, is_causal=False),
    "causal_bias_theta": dict(num_hidden_layers=3, attention_bias=True, is_causal=True,
                              rope_theta=1e6),
}


def ref_config(variant: str):
    from transformers import Qwen3Config

    fields = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=96, rms_norm_eps=1e-6,
                  rope_theta=10000.0, vocab_size=260, num_target_layers=4, block_size=BLOCK,
                  dflash_config={"target_layer_ids": [0, 2, 3], "mask_token_id": MASK})
    fields.update(VARIANTS[variant])
    if variant == "causal_bias_theta":  # default layer rule; block size in dflash_config
        fields["dflash_config"] = {"mask_token_id": MASK, "block_size": BLOCK}
        fields.pop("block_size")
    return Qwen3Config(**fields)


@torch.no_grad()
def make_reference(variant: str, path, seed: int):
    ref = dflash_model.DFlashDraftModel(ref_config(variant)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in ref.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def target():
    return load_model("tiny")


class Ours:
    """Our draft over a paged pool; each request's pages are handed out in a scrambled order."""

    def __init__(self, draft, num_requests):
        self.draft = draft
        self.pool = DraftKVPool(num_layers=draft.config.num_hidden_layers, num_pages=NUM_PAGES,
                                page_size=PAGE, num_kv_heads=draft.config.num_key_value_heads,
                                head_dim=draft.config.head_dim, dtype=torch.float32)
        free = list(range(NUM_PAGES - 1, 0, -1))
        self.pages = [[free.pop(3 * r % len(free)) for _ in range(NUM_PAGES // num_requests - 1)]
                      for r in range(num_requests)]

    def add_context(self, r, hidden, start):
        pos = torch.arange(start, start + hidden.shape[0])
        loc = torch.tensor([self.pages[r][p // PAGE] * PAGE + p % PAGE for p in pos.tolist()])
        self.draft.extend_context(hidden, pos, loc, self.pool)

    def propose(self, target, blocks, starts):
        width = max(len(p) for p in self.pages)
        table = torch.tensor([p + [0] * (width - len(p)) for p in self.pages])
        return self.draft.propose(block_ids=torch.tensor(blocks), start_positions=starts,
                                  page_table=table[:len(blocks)], pool=self.pool,
                                  embed=target.get_input_embeddings().weight,
                                  lm_head=target.get_output_weight())


class Reference:
    """z-lab's loop body: one DynamicCache per request, cropped back to the context each step."""

    def __init__(self, ref):
        self.ref = ref
        self.cache = dflash_model._make_cache(ref.config)

    @torch.no_grad()
    def step(self, target, new_hidden, block, start):
        w_embed, w_head = target.get_input_embeddings().weight, target.get_output_weight()
        noise = torch.nn.functional.embedding(torch.tensor([block]), w_embed)
        pos = torch.arange(start - new_hidden.shape[0], start + len(block))[None]
        hidden = self.ref(target_hidden=new_hidden[None], noise_embedding=noise, position_ids=pos,
                          past_key_values=self.cache, use_cache=True)[:, 1 - len(block):, :]
        dflash_model._crop_to(self.cache, start)
        return self.ref.compute_logits(hidden, lambda h: torch.nn.functional.linear(h, w_head))[0]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_proposals_match_reference(tmp_path, target, variant):
    ref = make_reference(variant, tmp_path, seed=len(variant))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    draft = load_draft(str(tmp_path), target)
    assert draft.config.target_layer_ids == tuple(ref.target_layer_ids)
    assert draft.config.block_size == ref.block_size == BLOCK
    k_h = len(ref.target_layer_ids) * 128

    gen = torch.Generator().manual_seed(7)
    # three requests, contexts of different lengths, three steps with varying new context
    contexts = [[11, 3, 1], [4, 9, 2], [17, 1, 6]]
    ours, refs = Ours(draft, 3), [Reference(ref) for _ in range(3)]
    starts = [0, 0, 0]
    for step in range(3):
        blocks, expected = [], []
        for r in range(3):
            new = torch.randn(contexts[r][step], k_h, generator=gen)
            ours.add_context(r, new, starts[r])
            starts[r] += new.shape[0]
            block = [int(torch.randint(0, 256, (), generator=gen))] + [MASK] * (BLOCK - 1)
            blocks.append(block)
            expected.append(refs[r].step(target, new, block, starts[r]))
        got = ours.propose(target, blocks, list(starts))
        assert got.shape == (3, BLOCK - 1, 260) and got.dtype == torch.float32
        for r in range(3):
            assert rel_err(got[r], expected[r]) <= 1e-5, (variant, step, r)
            assert torch.equal(got[r].argmax(-1), expected[r].argmax(-1)), (variant, step, r)
