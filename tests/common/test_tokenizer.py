import json

import pytest

from common.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)

MULTIBYTE = "héllo wörld — 中文字符 😀👍🏽 ok"


def _stream(tok: Tokenizer, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny byte-level BPE checkpoint directory, trained on ASCII so that multi-byte characters
    decompose into several byte tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_end|>"],
    )
    raw.train_from_iterator(["hello world", "the quick brown fox", "hello there"] * 10, trainer)
    d = tmp_path_factory.mktemp("ckpt")
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None})
    )
    eot = raw.token_to_id("<|endoftext|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, 12345]}))
    return d


def test_byte_round_trip_multibyte():
    tok = ByteTokenizer()
    ids = tok.encode(MULTIBYTE)
    assert ids == list(MULTIBYTE.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == MULTIBYTE


def test_byte_special_tokens():
    tok = ByteTokenizer()
    assert tok.vocab_size == 260
    assert tok.eos_token_ids == (256,) and tok.bos_token_id == 258
    assert tok.MASK_TOKEN_ID == 257 and tok.PAD_TOKEN_ID == 259
    ids = tok.encode("a<|endoftext|>b")
    assert ids == [ord("a"), 256, ord("b")]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|endoftext|>b"
    assert tok.decode([257, 258, 259], skip_special_tokens=False) == "<|mask|><|bos|><|pad|>"
    with pytest.raises(ValueError):
        tok.decode([260])


def test_byte_invalid_utf8_replaced():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    assert tok.decode(list("中".encode())[:2]) == "\ufffd"


@pytest.mark.parametrize("text", [MULTIBYTE, "😀", "中", "plain ascii", ""])
def test_incremental_byte_detokenizer(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_holds_back_partial_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    emoji = list("😀".encode())
    assert [detok.push(b) for b in emoji[:3]] == ["", "", ""]
    assert detok.push(emoji[3]) == "😀"
    assert detok.push(ord("x")) == "x"
    # An unfinished character at the end comes out on flush, as decode would render it.
    detok.push(emoji[0])
    assert detok.flush() == "\ufffd"


def test_incremental_with_special_tokens_and_invalid_bytes():
    tok = ByteTokenizer()
    ids = [ord("a"), 0xE4, 0xB8, 256, 0xAD, 0xFF, ord("b"), *"中".encode(), 257]
    for skip in (True, False):
        pieces = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_with_prompt_context():
    tok = ByteTokenizer()
    prompt = tok.encode("say: ")
    gen = tok.encode("中文 ok")
    pieces = _stream(tok, gen, prompt_ids=prompt)
    assert "".join(pieces) == "中文 ok"


def test_hf_tokenizer_round_trip(hf_dir):
    tok = HFTokenizer(hf_dir)
    for text in ["hello world", "the quick brown fox", MULTIBYTE]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # Trained merges are used: a known word is fewer tokens than bytes.
    assert len(tok.encode("hello world")) < len("hello world")
    assert tok.vocab_size <= 300


def test_hf_tokenizer_special_ids(hf_dir):
    tok = HFTokenizer(hf_dir)
    raw_eot = tok.encode("<|endoftext|>")
    im_end = tok.encode("<|im_end|>")
    assert len(raw_eot) == 1 and len(im_end) == 1
    # tokenizer_config's eos first, then generation_config's ids, de-duplicated.
    assert tok.eos_token_ids == (im_end[0], raw_eot[0], 12345)
    assert tok.bos_token_id is None
    ids = tok.encode("hello<|im_end|>")
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "hello<|im_end|>"


def test_hf_tokenizer_without_configs(tmp_path, hf_dir):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_ids == () and tok.bos_token_id is None


def test_incremental_hf_detokenizer(hf_dir):
    tok = HFTokenizer(hf_dir)
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # multi-byte characters really are split
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)


def test_load_tokenizer(hf_dir, tmp_path):
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="tiny"):
        load_tokenizer("no/such/model")
