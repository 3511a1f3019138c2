"""The built-in model's corpus: the Python standard library's own source files.

They come from the interpreter that runs this (``sysconfig.get_paths()["stdlib"]``, under the
Python Software Foundation License), so every machine with Python has the corpus and nothing is
downloaded. Third-party packages installed inside that directory (``site-packages``,
``dist-packages``) are left out: they are not the PSF's. The held-out split is chosen by a hash
of each file's path relative to the library root, so it is the same on every machine and for
every Python version that has the file.

    python -m common.training.corpus --out DIR [--eval-permille 30]

writes ``DIR/train.jsonl`` and ``DIR/eval.jsonl`` (one ``{"path", "text"}`` object per file) and
``DIR/manifest.json`` (interpreter, root, file counts, a digest of the contents, licence).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
THIRD_PARTY_DIRS = ("site-packages", "dist-packages", "__pycache__")
TRAIN_FILE, EVAL_FILE, MANIFEST_FILE = "train.jsonl", "eval.jsonl", "manifest.json"


@dataclass(frozen=True)
class CorpusConfig:
    """Args:
        root: the library directory (default: this interpreter's standard library).
        eval_permille: files held out for evaluation, per thousand (by path hash).
        max_file_bytes: larger files (generated tables, test data) are left out.
    """

    root: Path | None = None
    eval_permille: int = 30
    max_file_bytes: int = 1_000_000

    def __post_init__(self) -> None:
        if not 0 <= self.eval_permille <= 1000:
            raise ValueError(f"eval_permille must be within 0..1000, got {self.eval_permille}")


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the root, '/'-separated
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str, eval_permille: int) -> bool:
    """Whether a file belongs to the evaluation split (a pure function of its path)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 1000 < eval_permille


def read_sources(config: CorpusConfig) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, eval) files, sorted by path; files that are not UTF-8 are left out."""
    root = config.root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in THIRD_PARTY_DIRS for part in rel.parts) or not path.is_file():
            continue
        if path.stat().st_size > config.max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        source = SourceFile(rel.as_posix(), text)
        (held_out if is_held_out(source.path, config.eval_permille) else train).append(source)
    if not train:
        raise ValueError(f"no training files found under {root}")
    return train, held_out


def write_corpus(out_dir: str | Path, config: CorpusConfig = CorpusConfig()) -> dict:
    """Write the two splits and the manifest into ``out_dir``; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = read_sources(config)
    digest = hashlib.sha256()
    for name, files in ((TRAIN_FILE, train), (EVAL_FILE, held_out)):
        with (out / name).open("w", encoding="utf-8") as f:
            for source in files:
                f.write(json.dumps({"path": source.path, "text": source.text}) + "\n")
                digest.update(source.path.encode() + b"\0" + source.text.encode() + b"\0")
    manifest = {
        "source": "the Python standard library of the interpreter that built it",
        "license": LICENSE,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "root": str(config.root or stdlib_root()),
        "excluded_dirs": list(THIRD_PARTY_DIRS),
        "max_file_bytes": config.max_file_bytes,
        "eval_permille": config.eval_permille,
        "split_rule": "sha256(relative path) first 8 hex digits mod 1000 < eval_permille",
        "train_files": len(train),
        "eval_files": len(held_out),
        "train_bytes": sum(len(s.text.encode()) for s in train),
        "eval_bytes": sum(len(s.text.encode()) for s in held_out),
        "sha256": digest.hexdigest(),
        "rebuild": "python -m common.training.corpus --out DIR "
                   f"--eval-permille {config.eval_permille}",
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(data: str | Path) -> dict | None:
    """The manifest of the corpus ``data`` belongs to (the corpus directory, or a file in it),
    if it has one."""
    data = Path(data)
    path = (data if data.is_dir() else data.parent) / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.training.corpus",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for train.jsonl, eval.jsonl, "
                                                "manifest.json")
    p.add_argument("--root", default=None, help="library directory (default: the stdlib)")
    p.add_argument("--eval-permille", type=int, default=CorpusConfig.eval_permille)
    args = p.parse_args(argv)
    config = CorpusConfig(root=Path(args.root) if args.root else None,
                          eval_permille=args.eval_permille)
    manifest = write_corpus(args.out, config)
    print(f"corpus: {manifest['train_files']} train files ({manifest['train_bytes'] / 1e6:.1f} "
          f"MB), {manifest['eval_files']} held out, from {manifest['root']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
