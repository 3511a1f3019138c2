"""Reading training data, the token stream, and its windows."""

from __future__ import annotations

import json

import pytest
import torch

from common.tokenizer import ByteTokenizer
from common.training.token_data import (Continuation, WindowSampler, held_out_windows,
                                        read_documents, spaced_windows, token_stream,
                                        token_stream_and_labels)


def test_read_documents_of_every_kind(tmp_path):
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text(json.dumps({"text": "a = 1\n"}) + "\n\n"
                     + json.dumps({"token_ids": [5, 6, 7]}) + "\n")
    assert read_documents(jsonl) == ["a = 1\n", [5, 6, 7]]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text(json.dumps({"path": "x.py", "text": "x\n"}) + "\n")
    (corpus / "eval.jsonl").write_text(json.dumps({"path": "y.py", "text": "y\n"}) + "\n")
    assert read_documents(corpus) == ["x\n"]  # a corpus directory means its training split
    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    (plain / "b.txt").write_text("bee")
    (plain / "sub" / "a.py").write_text("ay")
    assert read_documents(plain) == ["bee", "ay"]  # every file, in path order
    (tmp_path / "one.py").write_text("one")
    assert read_documents(tmp_path / "one.py") == ["one"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"path": "z"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_documents(bad)
    with pytest.raises(FileNotFoundError):
        read_documents(tmp_path / "missing")


def test_token_stream():
    tok = ByteTokenizer()
    stream = token_stream(["ab", [7, 8]], tok, separator=tok.EOS_TOKEN_ID, vocab_size=260)
    assert stream.tolist() == [97, 98, 256, 7, 8, 256] and stream.dtype == torch.int32
    assert token_stream(["ab"], tok, separator=None).tolist() == [97, 98]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        token_stream(["ab"], None, separator=None)
    with pytest.raises(ValueError, match="0..9"):
        token_stream([[3, 12]], None, separator=None, vocab_size=10)


def test_regenerated_lines_are_continuations_whose_prompts_are_not_labels(tmp_path):
    data = tmp_path / "regen.jsonl"
    data.write_text(json.dumps({"token_ids": [1, 2, 3, 4], "prompt_tokens": 3}) + "\n"
                    + json.dumps({"token_ids": [5, 6]}) + "\n")
    docs = read_documents(data)
    assert docs == [[1, 2, 3, 4], [5, 6]]
    assert isinstance(docs[0], Continuation) and docs[0].prompt_tokens == 3
    assert not isinstance(docs[1], Continuation)
    tok = ByteTokenizer()
    stream, labels = token_stream_and_labels(docs + ["a"], tok, separator=9)
    assert stream.tolist() == [1, 2, 3, 4, 9, 5, 6, 9, 97, 9]
    # the prompt and the separator after a continuation are not the model's; all else is
    assert labels.tolist() == [False, False, False, True, False, True, True, True, True, True]
    assert torch.equal(stream, token_stream(docs + ["a"], tok, separator=9))
    assert token_stream_and_labels([Continuation([1, 2], 1)], None,
                                   separator=None)[1].tolist() == [False, True]
    with pytest.raises(ValueError, match="0..2"):
        Continuation([1, 2], 3)


def test_window_sampler_draws_labels_beside_the_same_windows():
    stream = torch.arange(100, dtype=torch.int32)
    labels = stream % 3 == 0
    a = WindowSampler(stream, 10, seed=5, labels=labels)
    b = WindowSampler(stream, 10, seed=5)
    windows, window_labels = a.sample_with_labels(4)
    assert torch.equal(windows, b.sample(4))
    assert torch.equal(window_labels, windows % 3 == 0)
    plain, all_labels = b.sample_with_labels(2)
    assert all_labels.all() and all_labels.shape == plain.shape
    with pytest.raises(ValueError, match="must match the stream"):
        WindowSampler(stream, 10, seed=0, labels=labels[:-1])


def test_window_sampler_is_seeded_and_resumable():
    stream = torch.arange(100, dtype=torch.int32)
    a, b = WindowSampler(stream, 10, seed=3), WindowSampler(stream, 10, seed=3)
    first = a.sample(4)
    assert torch.equal(first, b.sample(4)) and first.dtype == torch.int64
    assert first.shape == (4, 10) and torch.equal(first[:, 1:] - first[:, :-1],
                                                  torch.ones(4, 9, dtype=torch.int64))
    state = a.state()
    after = a.sample(3)
    b.load_state(state)
    assert torch.equal(b.sample(3), after)
    with pytest.raises(ValueError, match="fewer than one window"):
        WindowSampler(stream, 101, seed=0)


def test_spaced_windows():
    stream = torch.arange(50, dtype=torch.int32)
    w = spaced_windows(stream, 10, 5)
    assert w[:, 0].tolist() == [0, 10, 20, 30, 40] and w[-1, -1] == 49
    assert spaced_windows(stream, 50, 8).tolist() == [list(range(50))]


def test_held_out_windows_are_spaced_windows_of_the_documents_stream(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"token_ids": list(range(i * 10, i * 10 + 10))}) + "\n"
                            for i in range(3)))
    windows = held_out_windows(data, None, 99, 8, 3)
    stream = token_stream(read_documents(data), None, separator=99)
    assert windows == spaced_windows(stream, 8, 3).tolist()
    assert len(windows) == 3 and all(len(w) == 8 and type(w[0]) is int for w in windows)
