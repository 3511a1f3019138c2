"""The standard-library corpus: which files, which split, what the manifest records."""

from __future__ import annotations

import json

import pytest

from common.training.corpus import (CorpusConfig, is_held_out, read_sources, stdlib_root,
                                    write_corpus)
from tests.common.training.conftest import EVAL_PERMILLE, HELD_OUT


def test_split_is_a_pure_function_of_the_path():
    paths = [f"pkg/m{i}.py" for i in range(10)]
    assert {p for p in paths if is_held_out(p, EVAL_PERMILLE)} == HELD_OUT
    assert not any(is_held_out(p, 0) for p in paths)
    assert all(is_held_out(p, 1000) for p in paths)


def test_third_party_undecodable_large_and_empty_files_are_left_out(tmp_path):
    (tmp_path / "site-packages" / "lib").mkdir(parents=True)
    (tmp_path / "site-packages" / "lib" / "x.py").write_text("x = 1\n")
    (tmp_path / "dist-packages").mkdir()
    (tmp_path / "dist-packages" / "y.py").write_text("y = 1\n")
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (tmp_path / "empty.py").write_text("\n\n")
    (tmp_path / "big.py").write_text("z = 0\n" * 1000)
    (tmp_path / "notes.txt").write_text("not python\n")
    (tmp_path / "kept.py").write_text("def f():\n    return 1\n")
    train, held_out = read_sources(CorpusConfig(root=tmp_path, eval_permille=0,
                                                max_file_bytes=1000))
    assert [s.path for s in train] == ["kept.py"] and held_out == []


def test_write_corpus(source_root, tmp_path):
    manifest = write_corpus(tmp_path, CorpusConfig(root=source_root,
                                                   eval_permille=EVAL_PERMILLE))
    rows = {name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("train.jsonl", "eval.jsonl")}
    assert {r["path"] for r in rows["eval.jsonl"]} == HELD_OUT
    assert len(rows["train.jsonl"]) == 10 - len(HELD_OUT)
    assert rows["train.jsonl"][0]["text"] == (source_root / "pkg/m1.py").read_text()
    assert manifest == json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["license"].startswith("PSF") and manifest["eval_files"] == len(HELD_OUT)
    assert manifest["train_bytes"] == sum(len(r["text"].encode()) for r in rows["train.jsonl"])
    # the same inputs give the same corpus, digest included
    again = write_corpus(tmp_path / "again", CorpusConfig(root=source_root,
                                                          eval_permille=EVAL_PERMILLE))
    assert again["sha256"] == manifest["sha256"]


def test_the_standard_library_corpus():
    train, held_out = read_sources(CorpusConfig())
    assert len(train) > 500 and 0 < len(held_out) < len(train) / 10
    for s in train + held_out:
        assert "site-packages" not in s.path and not s.path.startswith("/")
    assert (stdlib_root() / train[0].path).is_file()


def test_config_is_checked():
    with pytest.raises(ValueError, match="eval_permille"):
        CorpusConfig(eval_permille=1001)
    with pytest.raises(FileNotFoundError):
        read_sources(CorpusConfig(root=stdlib_root() / "no-such-dir"))
