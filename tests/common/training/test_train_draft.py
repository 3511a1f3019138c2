"""flashsplit train-draft: what it writes, that it loads in our engine and in z-lab's reference
with the same proposals, resumption, and greedy output equal to plain decoding."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import dflash.model as dflash_model  # the oracle (make venv installs it); never skipped
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.dflash import DraftKVPool, load_draft
from common.model.load import load_model
from common.sampling import SamplingParams
from common.training.draft_config import DraftArch, DraftTrainConfig
from common.training.schedule import Budget
from common.training.train_draft import train_draft
from router.cli import main as flashsplit

B = 6
ARGS = ["--block-size", str(B), "--layers", "2", "--head-dim", "32", "--seq-len", "48",
        "--batch-size", "3", "--anchors", "6", "--no-progress"]


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    """A draft for the built-in tiny target, 12 steps on the corpus, through the CLI."""
    out = tmp_path_factory.mktemp("draft")
    assert flashsplit(["train-draft", "--target", "tiny", "--data", str(corpus_dir), "--out",
                       str(out), "--steps", "12", "--checkpoint-every", "5", *ARGS]) == 0
    return out


def test_output_files_and_provenance(trained):
    for name in ("config.json", "model.safetensors", "provenance.json", "loss.png",
                 "checkpoint/training_state.pt"):
        assert (trained / name).is_file(), name
    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == B
    assert config["dflash_config"]["mask_token_id"] == 257  # tiny's <|mask|>
    p = json.loads((trained / "provenance.json").read_text())
    assert p["training"]["steps"] == 12 and p["target"] == "tiny"
    rows = p["training"]["history_every_n_steps"]["values"]
    assert rows[0][0] == 1 and rows[-1][1] < rows[0][1]  # the loss went down


class Reference:
    """z-lab's generation loop body for one request (DynamicCache cropped to the context)."""

    def __init__(self, ref):
        self.ref, self.cache = ref, dflash_model._make_cache(ref.config)

    @torch.no_grad()
    def step(self, target, new_hidden, block, start):
        embed, head = target.get_input_embeddings().weight, target.get_output_weight()
        noise = torch.nn.functional.embedding(torch.tensor([block]), embed)
        pos = torch.arange(start - new_hidden.shape[0], start + len(block))[None]
        hidden = self.ref(target_hidden=new_hidden[None], noise_embedding=noise, position_ids=pos,
                          past_key_values=self.cache, use_cache=True)[:, 1 - len(block):, :]
        dflash_model._crop_to(self.cache, start)
        return self.ref.compute_logits(hidden, lambda h: torch.nn.functional.linear(h, head))[0]


def test_loads_in_zlab_reference_with_identical_proposals(trained):
    target = load_model("tiny")
    ours = load_draft(str(trained), target)
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(trained), dtype=torch.float32).eval()
    assert list(ref.target_layer_ids) == list(ours.config.target_layer_ids)
    assert ref.block_size == B and ref.mask_token_id == 257
    target.set_dflash_layers_to_capture(ours.config.target_layer_ids)
    pool = DraftKVPool(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=32,
                       dtype=torch.float32)
    reference = Reference(ref)
    gen = torch.Generator().manual_seed(5)
    width = len(ours.config.target_layer_ids) * target.config.hidden_size
    start = 0
    for new in (5, 3, 1, 4):  # context grows step by step, as committed tokens do
        hidden = torch.randn(new, width, generator=gen)
        pos = torch.arange(start, start + new)
        ours.extend_context(hidden, pos, pos + 4, pool)
        start += new
        block = [int(torch.randint(0, 256, (), generator=gen))] + [257] * (B - 1)
        got = ours.propose(block_ids=torch.tensor([block]), start_positions=[start],
                           page_table=torch.arange(1, 16)[None], pool=pool,
                           embed=target.get_input_embeddings().weight,
                           lm_head=target.get_output_weight())[0]
        expected = reference.step(target, hidden, block, start)
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_with_the_trained_draft_equals_plain_greedy(trained):
    target = load_model("tiny")
    draft = load_draft(str(trained), target)
    prompts = [[104, 101, 108, 108, 111], [100, 101, 102, 32, 102, 40, 41, 58], [35]]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    cache = CacheConfig(page_size=4, num_pages=96)
    plain = LLMEngine(target, EngineConfig(cache=cache)).generate(prompts, params)
    for block in (B, 3):
        spec = LLMEngine(target, EngineConfig(cache=cache), draft=draft,
                         block_size=block).generate(prompts, params)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
        assert all(r.accept_lengths and max(r.accept_lengths) <= block for r in spec)


def config_for(corpus_dir, out, steps, **kw):
    return DraftTrainConfig(target="tiny", data=str(corpus_dir), out=str(out),
                            budget=Budget(max_steps=steps), arch=DraftArch(block_size=B,
                                                                           head_dim=32),
                            seq_len=48, batch_size=2, num_anchors=4, checkpoint_every=3,
                            progress=False, **kw)


def test_resume_continues_the_same_run(corpus_dir, tmp_path, monkeypatch):
    from common.training import train_draft as module

    train_draft(config_for(corpus_dir, tmp_path / "whole", 7))
    real_step = module._Run.train_step

    def dies_after_four(self, lr):
        if self.step == 4:
            raise KeyboardInterrupt
        return real_step(self, lr)

    monkeypatch.setattr(module._Run, "train_step", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        train_draft(config_for(corpus_dir, tmp_path / "cut", 7))
    monkeypatch.setattr(module._Run, "train_step", real_step)
    with pytest.raises(ValueError, match="--resume"):
        train_draft(config_for(corpus_dir, tmp_path / "cut", 7))
    with pytest.raises(ValueError, match="num_anchors"):
        train_draft(replace(config_for(corpus_dir, tmp_path / "cut", 7, resume=True),
                            num_anchors=5))
    # the same data named by a relative path is the same run (the first named it absolutely)
    monkeypatch.chdir(corpus_dir.parent)
    train_draft(replace(config_for(corpus_dir, tmp_path / "cut", 7, resume=True),
                        data=corpus_dir.name))  # from step 3
    whole = torch.load(tmp_path / "whole/checkpoint/training_state.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut/checkpoint/training_state.pt", weights_only=True)
    assert whole["step"] == cut["step"] == 7
    assert [h[0] for h in cut["history"]] == list(range(1, 8))
    for name, value in whole["draft"].items():
        assert torch.equal(value, cut["draft"][name]), name
    with pytest.raises(FileNotFoundError):
        train_draft(config_for(corpus_dir, tmp_path / "none", 2, resume=True))


def test_config_is_checked(corpus_dir, tmp_path):
    with pytest.raises(ValueError, match="must exceed the block size"):
        replace(config_for(corpus_dir, tmp_path, 1), seq_len=B)
    assert flashsplit(["train-draft", "--target", "tiny", "--data", str(corpus_dir), "--out",
                       str(tmp_path), "--target-layer-ids", "1,x", *ARGS]) == 2


def test_regenerated_data_trains_on_the_targets_tokens_only(tmp_path, monkeypatch):
    from common.training import draft_forward, train_draft as module

    lines = [{"token_ids": [(7 * i + j) % 250 for j in range(40)], "prompt_tokens": 24}
             for i in range(6)]
    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    seen = []
    real_loss = draft_forward.block_loss

    def recording(*args, labels=None, **kw):
        seen.append(labels)
        return real_loss(*args, labels=labels, **kw)

    monkeypatch.setattr(module, "block_loss", recording)
    p = train_draft(replace(config_for(data, tmp_path / "ours", 2), data=str(data)))
    # 16 of every 41 tokens (40 ids and the separator) are the target's
    assert p["data_tokens"] == 246 and p["label_tokens"] == 96
    assert "target's own tokens only" in p["training"]["objective"]
    assert len(seen) == 2 and all(s is not None and not s.all() and s.any() for s in seen)
    seen.clear()
    p = train_draft(replace(config_for(data, tmp_path / "all", 2), data=str(data),
                            train_on_prompts=True))
    assert p["label_tokens"] == p["data_tokens"]
    assert len(seen) == 2 and all(s.all() for s in seen)  # every token a label
