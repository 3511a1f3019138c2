"""The byte-level BPE tokenizer: exact round trips, its special tokens, and that the serving
side's HFTokenizer reads what it saves."""

from __future__ import annotations

import json

import pytest

from common.tokenizer import HFTokenizer, IncrementalDetokenizer, load_tokenizer
from common.training.bpe import EOS_TOKEN, MASK_TOKEN, save_tokenizer, train_bpe

CODE = ("def greet(name: str) -> str:\n    \"\"\"Say hello.\"\"\"\n"
        "    return f'héllo {name} ✓'\n\n\nclass Box:\n\tpass\n")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    save_tokenizer(train_bpe([CODE] * 50, vocab_size=300), out, model_max_length=256)
    return out


def test_round_trip_and_special_tokens(saved):
    tok = load_tokenizer(str(saved))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size <= 300
    ids = tok.encode(CODE)
    assert len(ids) < len(CODE.encode()) / 2  # merges learned from the text
    assert tok.decode(ids) == CODE
    assert tok.decode(tok.encode("🐍 unseen ∑")) == "🐍 unseen ∑"  # bytes never seen
    assert tok.encode(EOS_TOKEN) == [0] and tok.encode(MASK_TOKEN) == [1]
    assert tok.eos_token_ids == (0,)
    assert tok.decode([0, *ids, 1]) == CODE  # special tokens are skipped
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == CODE
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS_TOKEN and config["model_max_length"] == 256


def test_vocab_must_cover_the_bytes():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe([CODE], vocab_size=200)
