"""The built-in model's tokenizer: byte-level BPE trained on the corpus with ``tokenizers``.

Byte-level, so any text encodes (no unknown token) and decoding gives the text back exactly.
Two special tokens come first: ``<|endoftext|>`` (id 0: separates documents, ends generation)
and ``<|mask|>`` (id 1: the DFLASH draft's mask token, never in the text).

    python -m common.training.bpe --corpus DIR --out DIR [--vocab-size 8192]

writes ``tokenizer.json`` and ``tokenizer_config.json`` (which names the end-of-text token, so
``common.tokenizer.HFTokenizer`` finds it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 8192


def train_bpe(texts: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE,
              min_frequency: int = 2):
    """A ``tokenizers.Tokenizer`` trained on ``texts``, at most ``vocab_size`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover the 256 bytes and the special tokens, got "
                         f"{vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: str | Path, *, model_max_length: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; returns the tokenizer.json path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tok.save(str(path))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    from common.training.token_data import read_documents

    p = argparse.ArgumentParser(prog="python -m common.training.bpe",
                                description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True, help="training.corpus directory (or any --data)")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--model-max-length", type=int, default=4096)
    args = p.parse_args(argv)
    docs = [d for d in read_documents(args.corpus) if isinstance(d, str)]
    tok = train_bpe(docs, vocab_size=args.vocab_size)
    path = save_tokenizer(tok, args.out, model_max_length=args.model_max_length)
    print(f"tokenizer: {tok.get_vocab_size()} ids, written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
